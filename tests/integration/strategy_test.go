package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// stuckBound is how long a change may take before the scenario counts it
// stuck: many times what the split changes take at this scale, with
// virt-handler's delays of a domain paused on an I/O error (10 s doubling
// to 3 min, 0.5 s to 9 s here) between its passes.
const stuckBound = 2 * time.Minute

// TestStrategyOneRemovalAtATime: two volumes of one attachment pod are
// unpublished at once from a VM while the second's device has vanished.
// Written together, every virt-handler that mounts removed volumes again
// (v1.7.0 here, Harvester 1.8) deadlocks (kubevirt PR 18044): the first is
// mounted again from the old pod, the pass fails on the second before
// Unmount, and the first stays Ready for good. The vanished device pauses
// the domain on an I/O error, and while the VMI says so OneRemovalAtATime
// writes the second only once virt-handler has unmounted the first, and
// both detach. KubeVirt
// main skips removed volumes, so there the rule is not needed.
func TestStrategyOneRemovalAtATime(t *testing.T) {
	for _, tc := range []struct {
		name     string
		mode     kubevirtsim.Mode
		version  kubevirtsim.Version
		strategy hotplug.Strategy
		stuck    bool
	}{
		{"v1.7.0-rule-on", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, hotplug.StrategyFor("v1.7.0"), false},
		{"v1.7.0-rule-off", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, hotplug.Strategy{Name: "off"}, true},
		{"main-rule-off", kubevirtsim.ModeDeclarative, kubevirtsim.VMain, hotplug.Strategy{Name: "off"}, false},
		// virt-controller 1.5 deletes the old attachment pod once the new one
		// runs, unmounted volumes or not, so the remount cannot hold it.
		{"v1.5.3-legacy-rule-off", kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3, hotplug.Strategy{Name: "off"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := framework.StartHost(t, kubevirtsim.Options{Mode: tc.mode, Version: tc.version, Scale: scale, BindClasslessPVCs: true})
			qcfg := queueConfig()
			qcfg.Strategy = tc.strategy
			ctrl := h.StartController(t, framework.ControllerOptions{Backend: kvbackend.BackendAuto, Queue: qcfg})
			kv := kubevirt.NewForConfigOrDie(h.Env.Config)
			vm := "rm-vm"
			h.CreateVMs(t, vm)
			vols := h.CreateVolumes(t, "rm", 2)
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			a := newAttacher(func() csiClient { return ctrl.Client })
			if errs := both(vols, func(vol string) error { return a.publish(ctx, vm, vol) }); errs != nil {
				t.Fatalf("publish: %v", errs)
			}
			testwait.Until(ctx, t, "both volumes on one attachment pod", func() (bool, string) {
				vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
				if err != nil {
					return false, err.Error()
				}
				pods := map[string]string{}
				for _, vol := range vols {
					if e, ok := kubevirtsim.FindVolumeStatus(vmi, vol); ok && e.HotplugVolume != nil && e.Phase == kubevirtv1.VolumeReady {
						pods[vol] = string(e.HotplugVolume.AttachPodUID)
					}
				}
				return len(pods) == 2 && pods[vols[0]] == pods[vols[1]], fmt.Sprint(pods)
			})
			h.Sim.Faults().SetDeviceVanished(h.Namespace, vm, vols[1], true)
			// The guest's I/O to the disk pauses the domain, and virt-handler
			// says so before anything is unpublished.
			testwait.Until(ctx, t, "the VMI paused on an I/O error", func() (bool, string) {
				vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
				if err != nil {
					return false, err.Error()
				}
				for _, c := range vmi.Status.Conditions {
					if c.Type == kubevirtv1.VirtualMachineInstancePaused && c.Reason == "PausedIOError" {
						return true, ""
					}
				}
				return false, fmt.Sprint(vmi.Status.Conditions)
			})

			bounded, stop := context.WithTimeout(ctx, stuckBound)
			defer stop()
			errs := both(vols, func(vol string) error { return a.unpublish(bounded, vm, vol) })
			if !tc.stuck {
				if errs != nil {
					t.Fatalf("unpublish on %s with strategy %q: %v", tc.version, tc.strategy.Name, errs)
				}
				return
			}
			if errs[vols[0]] == nil {
				t.Fatalf("the removal of %s finished on %s with both removals written at once: no deadlock to show", vols[0], tc.version)
			}
			vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if e, ok := kubevirtsim.FindVolumeStatus(vmi, vols[0]); !ok || e.Phase != kubevirtv1.VolumeReady || kubevirtsim.HasVolume(vmi.Spec.Volumes, vols[0]) {
				t.Errorf("%s stuck, but not in the remount deadlock: entry %+v (listed %v)", vols[0], e, ok)
			}
		})
	}
}

// TestRemovalWithALaterAddNeedsNoRule: a volume is unpublished from a VM
// while another, whose status entry sorts after it, is published to it.
// Up to KubeVirt 1.8 virt-handler looks the new volume up in the removed
// one's old attachment pod (first-UID reuse) and misses, a HotplugFailed
// Event from 1.6 (v1.7.0 here, where one declarative write carries both).
// The miss lasts only until virt-controller deletes the old pod, and the
// removed entry with it, so both changes finish with the release's own
// strategy, which has no rule for it. On 1.5 a miss would fail the whole
// pass, but legacy hotplug, the only mode of 1.5, hands the VMI the two
// changes apart (the VM controller replays each queued request with its own
// VMI subresource call); the v1.5.3 case shows both finish there too, and
// does not ask for a miss, which its runs did not show.
func TestRemovalWithALaterAddNeedsNoRule(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mode    kubevirtsim.Mode
		version kubevirtsim.Version
		miss    string // the virt-handler Event of the first-UID miss ("": not asked for)
	}{
		{"v1.5.3-legacy", kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3, ""},
		{"v1.7.0-declarative", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, "HotplugFailed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := framework.StartHost(t, kubevirtsim.Options{Mode: tc.mode, Version: tc.version, Scale: scale, BindClasslessPVCs: true})
			qcfg := queueConfig()
			qcfg.Strategy = hotplug.StrategyFor(string(tc.version))
			ctrl := h.StartController(t, framework.ControllerOptions{Backend: kvbackend.BackendAuto, Queue: qcfg})
			vm := "mix-vm"
			h.CreateVMs(t, vm)
			vols := h.CreateVolumes(t, "mix", 2) // mix-00 sorts before mix-01
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			a := newAttacher(func() csiClient { return ctrl.Client })
			if err := a.publish(ctx, vm, vols[0]); err != nil {
				t.Fatalf("publish %s: %v", vols[0], err)
			}
			bounded, stop := context.WithTimeout(ctx, stuckBound)
			defer stop()
			errs := both(vols, func(vol string) error {
				if vol == vols[0] {
					return a.unpublish(bounded, vm, vol)
				}
				return a.publish(bounded, vm, vol)
			})
			if errs != nil {
				t.Fatalf("unpublish %s and publish %s on %s: %v", vols[0], vols[1], tc.version, errs)
			}
			if tc.miss == "" {
				return
			}
			kube := kubernetes.NewForConfigOrDie(h.Env.Config)
			evs, err := kube.CoreV1().Events(h.Namespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			var seen []string
			for _, e := range evs.Items {
				if e.InvolvedObject.Name == vm && e.Source.Component == "virt-handler" {
					seen = append(seen, e.Reason+": "+e.Message)
					if e.Reason == tc.miss && strings.Contains(e.Message, vols[1]) {
						return
					}
				}
			}
			t.Errorf("no %s Event naming %s: the first-UID miss this scenario is for did not happen (virt-handler Events: %v)", tc.miss, vols[1], seen)
		})
	}
}

// both runs call for each volume at once and returns the errors by volume,
// nil when every call succeeded.
func both(vols []string, call func(vol string) error) map[string]error {
	var mu sync.Mutex
	errs := map[string]error{}
	var wg sync.WaitGroup
	for _, vol := range vols {
		wg.Go(func() {
			if err := call(vol); err != nil {
				mu.Lock()
				errs[vol] = err
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(errs) == 0 {
		return nil
	}
	return errs
}
