package hotplug

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// onPods puts the VMI's entries on attachment pods, "volume" -> pod UID.
func onPods(vmi *kubevirtv1.VirtualMachineInstance, pods map[string]types.UID) *kubevirtv1.VirtualMachineInstance {
	for i := range vmi.Status.VolumeStatus {
		e := &vmi.Status.VolumeStatus[i]
		e.HotplugVolume.AttachPodUID = pods[e.Name]
	}
	return vmi
}

// withoutSpec drops volumes from the VMI spec, as KubeVirt does once a
// removal reached it; their entries stay until virt-handler unmounts them.
func withoutSpec(vmi *kubevirtv1.VirtualMachineInstance, vols ...string) *kubevirtv1.VirtualMachineInstance {
	vmi.Spec.Volumes = slices.DeleteFunc(vmi.Spec.Volumes, func(v kubevirtv1.Volume) bool { return slices.Contains(vols, v.Name) })
	return vmi
}

// pausedOnIOError gives the VMI the Paused condition virt-handler writes
// when a disk's device vanished.
func pausedOnIOError(vmi *kubevirtv1.VirtualMachineInstance) *kubevirtv1.VirtualMachineInstance {
	vmi.Status.Conditions = append(vmi.Status.Conditions, kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstancePaused, Status: "True", Reason: "PausedIOError",
	})
	return vmi
}

// The removals of one VM's mounted volumes are written one at a time while
// OneRemovalAtATime is on and the VMI is paused on an I/O error (a device
// may be gone, the deadlock's trigger): b and c wait until virt-handler let go of a, c
// too although it is on another pod (first-UID reuse looks removed entries
// up in the first entry's pod). With the rule off all three
// go in one write, the grouping that deadlocks virt-handler (kubevirt PR
// 18044). An entry still Ready counts as mounted although virt-controller
// cleared its pod UID while the pod replacing its attachment pod starts.
func TestDecideOneRemovalAtATime(t *testing.T) {
	t0 := time.Unix(1000, 0)
	pods := map[string]types.UID{"a": "pod-1", "b": "pod-1", "c": "pod-2"}
	ready := map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady, "b": kubevirtv1.VolumeReady, "c": kubevirtv1.VolumeReady}
	detachAll := func() *vmWork {
		w := &vmWork{intents: map[string]*intent{}, expect: map[string]expectation{}}
		for _, v := range []string{"a", "b", "c"} {
			w.intents[v] = &intent{vm: "vm1", volume: v, op: Detach, created: t0}
		}
		return w
	}
	abReady := map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady, "b": kubevirtv1.VolumeReady}
	aGoing := withoutSpec(onPods(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeUnMounted, "b": kubevirtv1.VolumeReady}), pods), "a")
	aGone := onPods(vmiWith(map[string]kubevirtv1.VolumePhase{"b": kubevirtv1.VolumeReady}), map[string]types.UID{"b": "pod-3"})
	for _, tc := range []struct {
		name     string
		strategy Strategy
		obs      observed
		intents  []string // detach intents left (default all)
		pending  []string // removals written and not shown yet
		want     []Change
		wait     map[string]string
		running  bool // the VMI is not paused on an I/O error
	}{{
		// No device gone, no trigger: the rule stays out of the way.
		name: "safe: a VM not paused on an I/O error removes all at once", strategy: SafeStrategy(), running: true,
		obs:  observed{vm: vmWith([]string{"a", "b", "c"}), vmi: onPods(vmiWith(ready), pods)},
		want: []Change{{"a", Detach}, {"b", Detach}, {"c", Detach}},
	}, {
		name: "safe: one at a time, whatever the pod", strategy: SafeStrategy(),
		obs:  observed{vm: vmWith([]string{"a", "b", "c"}), vmi: onPods(vmiWith(ready), pods)},
		want: []Change{{"a", Detach}},
		wait: map[string]string{"b": "removing one mounted volume of the VM at a time, behind a", "c": "behind a"},
	}, {
		name: "rule off: all at once", strategy: StrategyFor("main"),
		obs:  observed{vm: vmWith([]string{"a", "b", "c"}), vmi: onPods(vmiWith(ready), pods)},
		want: []Change{{"a", Detach}, {"b", Detach}, {"c", Detach}},
	}, {
		// virt-handler let go of a: mounted again or not, it can no longer
		// hold pod-1, so b's removal cannot deadlock behind it.
		name: "safe: the next goes once the previous is unmounted from its pod", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: aGoing},
		intents: []string{"b"},
		want:    []Change{{"b", Detach}},
	}, {
		name: "safe: the next waits while the previous is mounted to virt-launcher", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: withoutSpec(onPods(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeMounted, "b": kubevirtv1.VolumeReady}), pods), "a")},
		intents: []string{"b"},
		wait:    map[string]string{"b": "behind a"},
	}, {
		name: "safe: the next waits while the previous, taken, is still Ready", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: withoutSpec(onPods(vmiWith(abReady), pods), "a")},
		intents: []string{"b"},
		wait:    map[string]string{"b": "behind a"},
	}, {
		name: "safe: the next goes once the previous left the VMI", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: aGone},
		intents: []string{"b"},
		want:    []Change{{"b", Detach}},
	}, {
		name: "safe: a legacy removal queued for the pod holds the next", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"a", "b"}, removeReq("a")), vmi: onPods(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady, "b": kubevirtv1.VolumeReady}), pods)},
		intents: []string{"b"},
		wait:    map[string]string{"b": "behind a"},
	}, {
		name: "safe: a volume only the VMI has is no removal in flight", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: onPods(vmiWith(map[string]kubevirtv1.VolumePhase{"b": kubevirtv1.VolumeReady, "d": kubevirtv1.VolumeReady}), map[string]types.UID{"b": "pod-1", "d": "pod-1"})},
		intents: []string{"b"},
		want:    []Change{{"b", Detach}},
	}, {
		// virt-controller clears the pod UID of the entries in the spec
		// while the pod replacing their attachment pod starts; b is still
		// mounted from pod-1 beside the removed a.
		name: "safe: a mounted volume whose new attachment pod is starting is held", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: withoutSpec(onPods(vmiWith(abReady), map[string]types.UID{"a": "pod-1"}), "a")},
		intents: []string{"b"},
		wait:    map[string]string{"b": "behind a"},
	}, {
		name: "safe: our removal not yet in the VMI holds the next while their new pod starts", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: vmiWith(abReady)},
		intents: []string{"a", "b"},
		pending: []string{"a"},
		wait:    map[string]string{"b": "behind a"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			w := detachAll()
			for _, v := range tc.pending {
				w.expect[v] = expectation{op: Detach, since: t0}
			}
			if tc.intents != nil {
				for v := range w.intents {
					if !slices.Contains(tc.intents, v) {
						delete(w.intents, v)
					}
				}
			}
			if !tc.running {
				tc.obs.vmi = pausedOnIOError(tc.obs.vmi.DeepCopy())
			}
			cfg := Config{MaxHold: time.Nanosecond, Strategy: tc.strategy}
			p := decide(t0, cfg, w, facts{o: tc.obs})
			if !slices.Equal(p.changes, tc.want) {
				t.Errorf("changes %v, want %v", p.changes, tc.want)
			}
			for v, want := range tc.wait {
				if got := p.waits[v]; !strings.Contains(got.why, want) || got.reason != "" {
					t.Errorf("%s waits %+v, want the queue's own wait mentioning %q", v, got, want)
				}
			}
		})
	}
}

// StrategyFor keeps the rule for the releases whose virt-controller keeps an
// old attachment pod the remount can hold (1.6 and later) and an unknown
// release, and drops it for KubeVirt 1.5 and main.
func TestStrategyFor(t *testing.T) {
	for version, want := range map[string]bool{
		"v1.5.3": false, "1.6.6": true, "v1.7.0": true, "v1.8.4": true, "v1.9.0": true,
		"main": false, "": true, "garbage": true, "v1.4.0": true,
	} {
		got := StrategyFor(version)
		if got.OneRemovalAtATime != want || got.Name == "" {
			t.Errorf("StrategyFor(%q) = %+v, want OneRemovalAtATime %v and a name", version, got, want)
		}
	}
	if got := (Config{}).withDefaults().Strategy; got != AutoStrategy() {
		t.Errorf("a Config without a strategy gets %+v, want the automatic one", got)
	}
}

// versioned is a backend that learned the host's KubeVirt version.
type versioned struct {
	Backend
	version string
}

func (v versioned) KubeVirtVersion() string { return v.version }

// The automatic strategy becomes the found release's; an operator's
// strategy, or an unknown release, keeps what was configured.
func TestPickStrategy(t *testing.T) {
	operator := Strategy{Name: "operator", OneRemovalAtATime: true}
	for _, tc := range []struct {
		name       string
		configured Strategy
		backend    Backend
		want       Strategy
	}{
		{"auto on v1.7.0", Strategy{}, versioned{version: "v1.7.0"}, StrategyFor("v1.7.0")},
		{"auto on main", Strategy{}, versioned{version: "main"}, StrategyFor("main")},
		{"auto, version unknown", Strategy{}, versioned{}, AutoStrategy()},
		{"auto, backend without a version", Strategy{}, versionless{}, AutoStrategy()},
		{"operator's on main", operator, versioned{version: "main"}, operator},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := &Queue{cfg: Config{Strategy: tc.configured}.withDefaults(), backend: tc.backend}
			q.pickStrategy(context.Background())
			if q.cfg.Strategy != tc.want {
				t.Errorf("strategy %+v, want %+v", q.cfg.Strategy, tc.want)
			}
		})
	}
}

type versionless struct{ Backend }
