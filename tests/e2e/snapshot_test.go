package e2e

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
)

// TestSnapshotRestoreKeepsData: what a workload wrote before a snapshot is
// what a volume restored from it holds, on another node, even after the
// source volume changed; the restored volume is a copy, not a link.
func TestSnapshotRestoreKeepsData(t *testing.T) {
	nodetest.RequireRealDevices(t)
	work := t.TempDir()
	h, disks, guests, ctrl := twoGuests(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative}, driver.ControllerOptions{HostStorageClass: "longhorn"})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	capability := ext4Capability()
	src, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-snap-source", VolumeCapabilities: []*csi.VolumeCapability{capability},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	srcID := src.GetVolume().GetVolumeId()
	var before string
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[0], srcID, capability, func(dir string) {
		nodetest.WriteRandom(t, filepath.Join(dir, "data.bin"), 8<<20, 7)
		before = nodetest.Checksum(t, filepath.Join(dir, "data.bin"))
	})

	// The snapshotter calls CreateSnapshot until the answer says ready.
	var snap *csi.Snapshot
	testwait.Until(ctx, t, "the snapshot ready", func() (bool, string) {
		resp, err := ctrl.Client.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-e2e", SourceVolumeId: srcID})
		if err != nil {
			return false, err.Error()
		}
		snap = resp.GetSnapshot()
		return snap.GetReadyToUse(), "not ready"
	})
	if snap.GetSizeBytes() < 64<<20 {
		t.Errorf("snapshot size %d, want at least the source's %d", snap.GetSizeBytes(), 64<<20)
	}

	// The source changes after the snapshot; the restore must not see that.
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[0], srcID, capability, func(dir string) {
		nodetest.WriteRandom(t, filepath.Join(dir, "data.bin"), 8<<20, 8)
	})

	restored, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-snap-restored", VolumeCapabilities: []*csi.VolumeCapability{capability},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshotId()},
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[1], restored.GetVolume().GetVolumeId(), capability, func(dir string) {
		if got := nodetest.Checksum(t, filepath.Join(dir, "data.bin")); got != before {
			t.Errorf("restored volume holds %s, the snapshot was taken of %s", got, before)
		}
	})

	if _, err := ctrl.Client.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshotId()}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{srcID, restored.GetVolume().GetVolumeId()} {
		if _, err := ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatal(err)
		}
	}
}
