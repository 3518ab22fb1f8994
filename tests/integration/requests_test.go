package integration

import (
	"context"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestSubresourceQueuesABatchInOneWrite: on a legacy KubeVirt whose virt-api
// has 5 requests per second (v1.5.3), the subresource backend allowed to
// use the request list queues a batch of adds, and later of removes, with
// one status write each and no virt-api call; KubeVirt's VM controller
// carries them out. A retry of the done batch writes nothing. Without the
// request list it calls virt-api once per change.
func TestSubresourceQueuesABatchInOneWrite(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Version: kubevirtsim.V1_5_3, Scale: scale})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	h.CreateVMs(t, "vm-batch")
	claims := h.CreateVolumes(t, "pvc-batch", 5)
	hc, err := host.NewForConfig(h.ClientConfig(), h.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	changes := func(op hotplug.Op, vols []string) []hotplug.Change {
		var cs []hotplug.Change
		for _, v := range vols {
			cs = append(cs, hotplug.Change{Volume: v, Op: op})
		}
		return cs
	}
	expect := func(what string, outs []hotplug.Outcome, want hotplug.Result, statusWrites, calls int) {
		t.Helper()
		for i, o := range outs {
			if o.Result != want {
				t.Errorf("%s: change %d: %v (%v), want %v", what, i, o.Result, o.Err, want)
			}
		}
		st := h.Sim.Stats()
		if st.VMStatusWrites != statusWrites || st.AddVolume+st.RemoveVolume != calls {
			t.Errorf("%s: %d status writes and %d virt-api calls, want %d and %d", what, st.VMStatusWrites, st.AddVolume+st.RemoveVolume, statusWrites, calls)
		}
		h.Sim.ResetStats()
	}

	b := kubevirt.NewSubresource(hc)
	b.UseRequestList()
	h.Sim.ResetStats()
	expect("adds", b.Apply(ctx, "vm-batch", changes(hotplug.Attach, claims)), hotplug.Applied, 1, 0)
	for _, c := range claims {
		if _, err := h.Sim.WaitVolumeReady(ctx, h.Namespace, "vm-batch", c); err != nil {
			t.Fatalf("volume %s: %v", c, err)
		}
	}
	expect("adds again", b.Apply(ctx, "vm-batch", changes(hotplug.Attach, claims)), hotplug.AlreadyDone, 0, 0)
	expect("removes", b.Apply(ctx, "vm-batch", changes(hotplug.Detach, claims[:3])), hotplug.Applied, 1, 0)
	for _, c := range claims[:3] {
		if err := h.Sim.WaitVolumeDetached(ctx, h.Namespace, "vm-batch", c); err != nil {
			t.Fatalf("volume %s: %v", c, err)
		}
	}

	perCall := kubevirt.NewSubresource(hc)
	expect("removes, one call each", perCall.Apply(ctx, "vm-batch", changes(hotplug.Detach, claims[3:])), hotplug.Applied, 0, 2)
}
