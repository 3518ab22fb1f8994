package e2e

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
)

// TestCloneKeepsData: what a workload wrote to a volume before it was
// cloned is what the clone reads on another node, even after the source
// changed (the clone is a copy, not a link), and a clone asked larger than
// its source (Longhorn clones at the source's size) has the larger disk.
func TestCloneKeepsData(t *testing.T) {
	nodetest.RequireRealDevices(t)
	work := t.TempDir()
	h, disks, guests, ctrl := twoGuests(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative}, driver.ControllerOptions{HostStorageClass: "longhorn"})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	capability := ext4Capability()
	srcID, before := sourceWithData(ctx, t, ctrl, disks, h.Namespace, work, guests[0], "pvc-clone-source", 11)

	// The provisioner calls CreateVolume until the clone is bound and grown.
	var clone *csi.Volume
	testwait.Until(ctx, t, "the clone", func() (bool, string) {
		resp, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: "pvc-clone", VolumeCapabilities: []*csi.VolumeCapability{capability},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 96 << 20},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: srcID},
			}},
		})
		if err != nil {
			return false, err.Error()
		}
		clone = resp.GetVolume()
		return true, ""
	})
	if clone.GetCapacityBytes() != 96<<20 || clone.GetContentSource().GetVolume().GetVolumeId() != srcID {
		t.Errorf("clone %+v, want %d bytes cloned from %s", clone, 96<<20, srcID)
	}

	// The source changes after the clone; the clone must not see that.
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[0], srcID, capability, func(dir string) {
		nodetest.WriteRandom(t, filepath.Join(dir, "data.bin"), 8<<20, 12)
	})
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[1], clone.GetVolumeId(), capability, func(dir string) {
		if got := nodetest.Checksum(t, filepath.Join(dir, "data.bin")); got != before {
			t.Errorf("clone holds %s, the source held %s when it was cloned", got, before)
		}
	})
	if st, err := os.Stat(disks.BackingFile(clone.GetVolumeId())); err != nil || st.Size() != 96<<20 {
		t.Errorf("clone's disk: %v, want %d bytes", err, 96<<20)
	}

	for _, id := range []string{clone.GetVolumeId(), srcID} {
		if _, err := ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatal(err)
		}
	}
}
