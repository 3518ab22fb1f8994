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

// TestRestoreKeepsData: what a workload wrote before a snapshot is what a
// volume restored from it reads on another node, even after the source
// volume changed; the restored volume is a copy, not a link. A backup
// snapshot (VolumeSnapshotClass type: backup) is a copy in Harvester's
// backup target, so its restore works after the source is deleted too.
func TestRestoreKeepsData(t *testing.T) {
	nodetest.RequireRealDevices(t)
	for _, tc := range []struct {
		name         string
		mode         kubevirtsim.Mode
		params       map[string]string
		idPrefix     string // of the snapshot ID, after the namespace is known
		deleteSource bool
	}{
		{name: "snapshot", mode: kubevirtsim.ModeDeclarative},
		{name: "backup", mode: kubevirtsim.ModeLegacy, params: map[string]string{"type": "backup"}, idPrefix: "backup:", deleteSource: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			work := t.TempDir()
			h, disks, guests, ctrl := twoGuests(t, kubevirtsim.Options{Mode: tc.mode}, driver.ControllerOptions{HostStorageClass: "longhorn"})
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			capability := ext4Capability()
			srcID, before := sourceWithData(ctx, t, ctrl, disks, h.Namespace, work, guests[0], "pvc-"+tc.name+"-source", 7)

			// The snapshotter calls CreateSnapshot until the answer says ready.
			var snap *csi.Snapshot
			testwait.Until(ctx, t, "the "+tc.name+" ready", func() (bool, string) {
				resp, err := ctrl.Client.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: tc.name + "-e2e", SourceVolumeId: srcID, Parameters: tc.params})
				if err != nil {
					return false, err.Error()
				}
				snap = resp.GetSnapshot()
				return snap.GetReadyToUse(), "not ready"
			})
			if snap.GetSizeBytes() < 64<<20 || tc.idPrefix != "" && !strings.HasPrefix(snap.GetSnapshotId(), tc.idPrefix+h.Namespace+"/") {
				t.Errorf("%s %+v, want at least the source's %d bytes and an ID starting %q", tc.name, snap, 64<<20, tc.idPrefix)
			}

			// The source changes after the snapshot; the restore must not see that.
			mountOn(ctx, t, ctrl, disks, h.Namespace, work, guests[0], srcID, capability, func(dir string) {
				nodetest.WriteRandom(t, filepath.Join(dir, "data.bin"), 8<<20, 8)
			})
			if tc.deleteSource {
				if _, err := ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: srcID}); err != nil {
					t.Fatal(err)
				}
			}

			// The provisioner calls CreateVolume until the restore is complete.
			var restored *csi.Volume
			testwait.Until(ctx, t, "the volume restored from the "+tc.name, func() (bool, string) {
				resp, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
					Name: "pvc-" + tc.name + "-restored", VolumeCapabilities: []*csi.VolumeCapability{capability},
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
					t.Errorf("restored volume holds %s, the %s was taken of %s", got, tc.name, before)
				}
			})

			if _, err := ctrl.Client.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshotId()}); err != nil {
				t.Fatal(err)
			}
			left := []string{restored.GetVolumeId()}
			if !tc.deleteSource {
				left = append(left, srcID)
			}
			for _, id := range left {
				if _, err := ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
