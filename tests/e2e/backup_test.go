package e2e

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
)

// TestBackupRestoreKeepsData: what a workload wrote before a backup snapshot
// (VolumeSnapshotClass type: backup) is what a volume restored from it reads
// on another node, after the source changed and even after the source
// volume is gone: a backup is a copy in Harvester's backup target.
func TestBackupRestoreKeepsData(t *testing.T) {
	nodetest.RequireRealDevices(t)
	work := t.TempDir()
	h, disks, guests, ctrl := twoGuests(t, kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy}, driver.ControllerOptions{HostStorageClass: "longhorn"})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	capability := ext4Capability()
	src, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-backup-source", VolumeCapabilities: []*csi.VolumeCapability{capability},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	srcID := src.GetVolume().GetVolumeId()
	var before string
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[0], srcID, capability, func(dir string) {
		nodetest.WriteRandom(t, filepath.Join(dir, "data.bin"), 8<<20, 11)
		before = nodetest.Checksum(t, filepath.Join(dir, "data.bin"))
	})

	// The snapshotter calls CreateSnapshot until the answer says ready.
	var snap *csi.Snapshot
	testwait.Until(ctx, t, "the backup complete", func() (bool, string) {
		resp, err := ctrl.Client.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-backup-e2e", SourceVolumeId: srcID,
			Parameters: map[string]string{"type": "backup"}})
		if err != nil {
			return false, err.Error()
		}
		snap = resp.GetSnapshot()
		return snap.GetReadyToUse(), "not complete"
	})
	if !strings.HasPrefix(snap.GetSnapshotId(), "backup:"+h.Namespace+"/") || snap.GetSizeBytes() != 64<<20 {
		t.Errorf("backup snapshot %+v", snap)
	}

	// The source changes after the backup, then goes away.
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[0], srcID, capability, func(dir string) {
		nodetest.WriteRandom(t, filepath.Join(dir, "data.bin"), 8<<20, 12)
	})
	if _, err := ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: srcID}); err != nil {
		t.Fatal(err)
	}

	// The provisioner calls CreateVolume until the restore is complete.
	var restored *csi.Volume
	testwait.Until(ctx, t, "the volume restored from the backup", func() (bool, string) {
		resp, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: "pvc-backup-restored", VolumeCapabilities: []*csi.VolumeCapability{capability},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshotId()},
			}},
		})
		if err != nil {
			return false, err.Error()
		}
		restored = resp.GetVolume()
		return true, ""
	})
	mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[1], restored.GetVolumeId(), capability, func(dir string) {
		if got := nodetest.Checksum(t, filepath.Join(dir, "data.bin")); got != before {
			t.Errorf("restored volume holds %s, the backup was taken of %s", got, before)
		}
	})

	if _, err := ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: restored.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.Client.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshotId()}); err != nil {
		t.Fatal(err)
	}
}
