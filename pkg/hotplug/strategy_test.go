package hotplug

import (
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

// The removals of one VM are written one per attachment pod while
// OneRemovalPerPod is on: a and b share pod-1, so b waits for a's entry to
// leave the VMI, while c on pod-2 goes with a. With the rule off all three
// go in one write, the grouping that deadlocks virt-handler (kubevirt PR
// 18044). A removal whose volume has no pod yet is never held.
func TestDecideOneRemovalPerPod(t *testing.T) {
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
	aGoing := withoutSpec(onPods(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeUnMounted, "b": kubevirtv1.VolumeReady}), pods), "a")
	aGone := onPods(vmiWith(map[string]kubevirtv1.VolumePhase{"b": kubevirtv1.VolumeReady}), map[string]types.UID{"b": "pod-3"})
	for _, tc := range []struct {
		name     string
		strategy Strategy
		obs      observed
		intents  []string // detach intents left (default all)
		want     []Change
		wait     map[string]string
	}{{
		name: "safe: one per pod", strategy: SafeStrategy(),
		obs:  observed{vm: vmWith([]string{"a", "b", "c"}), vmi: onPods(vmiWith(ready), pods)},
		want: []Change{{"a", Detach}, {"c", Detach}},
		wait: map[string]string{"b": "removing one volume at a time from attachment pod pod-1, behind a"},
	}, {
		name: "rule off: all at once", strategy: StrategyFor("main"),
		obs:  observed{vm: vmWith([]string{"a", "b", "c"}), vmi: onPods(vmiWith(ready), pods)},
		want: []Change{{"a", Detach}, {"b", Detach}, {"c", Detach}},
	}, {
		name: "safe: the next waits while the VMI lists the previous", strategy: SafeStrategy(),
		obs:     observed{vm: vmWith([]string{"b"}), vmi: aGoing},
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
	}} {
		t.Run(tc.name, func(t *testing.T) {
			w := detachAll()
			if tc.intents != nil {
				for v := range w.intents {
					if !slices.Contains(tc.intents, v) {
						delete(w.intents, v)
					}
				}
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

// StrategyFor keeps every rule for the releases that have the bugs and an
// unknown release, and drops them only for KubeVirt main.
func TestStrategyFor(t *testing.T) {
	for version, want := range map[string]bool{"v1.5.3": true, "1.6.6": true, "v1.7.0": true, "v1.8.4": true, "v1.9.0": true, "main": false, "": true, "garbage": true} {
		if got := StrategyFor(version); got.OneRemovalPerPod != want || got.Name == "" {
			t.Errorf("StrategyFor(%q) = %+v, want OneRemovalPerPod %v and a name", version, got, want)
		}
	}
	if got := (Config{}).withDefaults().Strategy; got != SafeStrategy() {
		t.Errorf("a Config without a strategy gets %+v, want the safe one", got)
	}
}
