package simhost

import (
	"context"
	"fmt"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// A Longhorn volume that faults under a running attachment pod takes the
// pod's device with it: the VM's plugged disk fails its I/O and
// virt-handler reports the domain paused on an I/O error, on either control
// plane, until Longhorn attaches the volume on the VM's host node again.
func TestLonghornFaultedVolumePausesTheVM(t *testing.T) {
	for _, tc := range []struct {
		name string
		real string
		sim  kubevirtsim.Options
	}{
		{name: "real-v1.7.0-legacy", real: "v1.7.0", sim: kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Scale: 0.05}},
		{name: "sim-v1.7.0-declarative", sim: kubevirtsim.Options{Version: kubevirtsim.V1_7_0, Mode: kubevirtsim.ModeDeclarative, Scale: 0.05}},
	} {
		t.Run(tc.name, func(t *testing.T) { longhornFaultPausesVM(t, tc.real, tc.sim) })
	}
}

func longhornFaultPausesVM(t *testing.T, real string, so kubevirtsim.Options) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const host = "harvester-1"
	h := startOnHostNodes(ctx, t, real, so, map[string]string{"node-0": host})
	vols, lhName := hotplugOneVolume(ctx, t, h, kubeVirtOf(t, h), "node-0")
	waitEntryReady(ctx, t, h, vols[0])
	if paused, _ := pausedOnIOError(vmiOf(ctx, h, "node-0")); paused {
		t.Fatal("VMI paused on an I/O error before any fault")
	}

	// Faulted until the test ends it, so that the pause has no deadline to
	// race.
	h.Longhorn.FaultVolumeUntil(lhName, time.Now().Add(time.Hour))
	testwait.Until(ctx, t, "the VMI paused on an I/O error", func() (bool, string) {
		return pausedOnIOError(vmiOf(ctx, h, "node-0"))
	})

	h.Longhorn.FaultVolumeUntil(lhName, time.Now())
	testwait.Until(ctx, t, "the Paused condition gone once the volume is attached again", func() (bool, string) {
		paused, why := pausedOnIOError(vmiOf(ctx, h, "node-0"))
		if paused {
			return false, why
		}
		lv, err := h.Longhorn.Volume(ctx, lhName)
		if err != nil {
			return false, err.Error()
		}
		if lv.Status.State != simlonghorn.VolumeStateAttached || lv.Status.CurrentNodeID != host {
			t.Errorf("the Paused condition went while Longhorn volume %s is %s on %q, not attached on %s again",
				lhName, lv.Status.State, lv.Status.CurrentNodeID, host)
		}
		return true, ""
	})
}

// vmiOf reads a VMI, nil when absent.
func vmiOf(ctx context.Context, h *Host, name string) *kubevirtv1.VirtualMachineInstance {
	_, vmi := h.VM(ctx, name)
	return vmi
}

// pausedOnIOError reports whether the VMI carries virt-handler's Paused
// condition for an I/O error.
func pausedOnIOError(vmi *kubevirtv1.VirtualMachineInstance) (bool, string) {
	if vmi == nil {
		return false, "no VMI"
	}
	for _, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstancePaused {
			return c.Reason == virthandler.ReasonPausedIOError, fmt.Sprintf("Paused %s %s", c.Status, c.Reason)
		}
	}
	return false, fmt.Sprintf("no Paused condition; volumes %+v", vmi.Status.VolumeStatus)
}
