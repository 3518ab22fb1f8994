package kubevirtsim

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// declarativeEdit adds and removes volumes of vm1 in one VM update.
func declarativeEdit(ctx context.Context, t *testing.T, s *Sim, ns string, add, remove []string) {
	t.Helper()
	c := proxyKV(t, s)
	testwait.Until(ctx, t, fmt.Sprintf("the VM edited (add %v, remove %v)", add, remove), func() (bool, string) {
		err := patchVMVolumes(ctx, t, s, c, ns, "vm1", add, remove)
		return err == nil, fmt.Sprint(err)
	})
}

// hasHandlerEvent reports whether virt-handler recorded an Event of this
// reason on the VMI.
func hasHandlerEvent(ctx context.Context, s *Sim, ns, reason string) (bool, string) {
	evs, err := s.c.kube.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, err.Error()
	}
	var seen []string
	for _, e := range evs.Items {
		if e.InvolvedObject.Name == "vm1" && e.Source.Component == "virt-handler" {
			seen = append(seen, e.Reason+": "+e.Message)
			if e.Reason == reason {
				return true, ""
			}
		}
	}
	return false, strings.Join(seen, "; ")
}

// First-UID reuse on the simulated control plane: pvc-a, removed, stays
// listed while its unmount fails; pvc-b, added after it, is looked up in
// pvc-a's old pod, fails (HotplugFailed) and waits for the whole removal.
// From v1.9.0 (main here) it uses its own pod and goes Ready at once.
func TestHandlerFirstUIDReuse(t *testing.T) {
	perVersion(t, []Version{V1_7_0, VMain}, func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{Mode: ModeDeclarative}, "pvc-a", "pvc-b")
		declarativeEdit(ctx, t, s, ns, []string{"pvc-a"}, nil)
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		s.Faults().SetUnmountFails(ns, "vm1", "pvc-a", true)
		declarativeEdit(ctx, t, s, ns, []string{"pvc-b"}, []string{"pvc-a"})
		if v == VMain {
			ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
			return
		}
		waitEntry(t, s, ns, "pvc-b", "pvc-b named with its running pod", func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
			p := runningPodHolding(s, vmi, "pvc-b")
			return ok && p != nil && e.HotplugVolume.AttachPodUID == p.UID
		})
		testwait.Until(ctx, t, "a HotplugFailed Event", func() (bool, string) { return hasHandlerEvent(ctx, s, ns, "HotplugFailed") })
		waitPasses(t, s, ns, 5)
		_, vmi := s.VM(ns, "vm1")
		if e, _ := FindVolumeStatus(vmi, "pvc-b"); e.Phase != kubevirtv1.HotplugVolumeAttachedToNode || s.handler.isMounted(vmi, "pvc-b") {
			t.Fatalf("pvc-b went on behind a listed removal on %s:\n%s", v, describe(s, vmi))
		}
		s.Faults().SetUnmountFails(ns, "vm1", "pvc-a", false)
		ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
	})
}

// The remount deadlock on the simulated control plane (kubevirt PR 18044):
// pvc-a and pvc-b of one pod are removed together while pvc-b's device
// vanished. On v1.7.0 pvc-a is mounted again from the old pod on every pass
// and the pass fails on pvc-b before Unmount: pvc-a stays Ready, the pod
// stays. On main both go.
func TestHandlerRemountDeadlock(t *testing.T) {
	perVersion(t, []Version{V1_7_0, VMain}, func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{Mode: ModeDeclarative}, "pvc-a", "pvc-b")
		declarativeEdit(ctx, t, s, ns, []string{"pvc-a", "pvc-b"}, nil)
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
		s.Faults().SetDeviceVanished(ns, "vm1", "pvc-b", true)
		declarativeEdit(ctx, t, s, ns, nil, []string{"pvc-a", "pvc-b"})
		if v == VMain {
			detached(t, s, ns, "vm1", "pvc-a", 30*time.Second)
			detached(t, s, ns, "vm1", "pvc-b", 30*time.Second)
			return
		}
		testwait.Until(ctx, t, "a SyncFailed Event", func() (bool, string) { return hasHandlerEvent(ctx, s, ns, "SyncFailed") })
		waitPasses(t, s, ns, 5)
		_, vmi := s.VM(ns, "vm1")
		e, _ := FindVolumeStatus(vmi, "pvc-a")
		if e.Phase != kubevirtv1.VolumeReady || e.Target != "" || !s.handler.isMounted(vmi, "pvc-a") || len(s.c.attachmentPods(vmi)) != 1 {
			t.Fatalf("no deadlock on %s:\n%s", v, describe(s, vmi))
		}
	})
}

// Unmount stopping at its first failure on the simulated control plane:
// pvc-a's unmount fails, so pvc-b, removed with it, stays mounted and Ready
// on v1.7.0; from v1.9.0 (main) pvc-b goes.
func TestHandlerUnmountStopsAtFirstFailure(t *testing.T) {
	perVersion(t, []Version{V1_7_0, VMain}, func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{Mode: ModeDeclarative}, "pvc-a", "pvc-b")
		declarativeEdit(ctx, t, s, ns, []string{"pvc-a", "pvc-b"}, nil)
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
		s.Faults().SetUnmountFails(ns, "vm1", "pvc-a", true)
		declarativeEdit(ctx, t, s, ns, nil, []string{"pvc-a", "pvc-b"})
		if v == VMain {
			waitEntry(t, s, ns, "pvc-b", "pvc-b unmounted", func(_ *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
				return !ok || e.Phase == kubevirtv1.HotplugVolumeUnMounted
			})
		} else {
			testwait.Until(ctx, t, "a SyncFailed Event", func() (bool, string) { return hasHandlerEvent(ctx, s, ns, "SyncFailed") })
			waitPasses(t, s, ns, 5)
			_, vmi := s.VM(ns, "vm1")
			if e, _ := FindVolumeStatus(vmi, "pvc-b"); e.Phase != kubevirtv1.VolumeReady || !s.handler.isMounted(vmi, "pvc-b") {
				t.Fatalf("pvc-b unmounted past a failed path on %s:\n%s", v, describe(s, vmi))
			}
		}
		s.Faults().SetUnmountFails(ns, "vm1", "pvc-a", false)
		detached(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		detached(t, s, ns, "vm1", "pvc-b", 30*time.Second)
	})
}
