package driver

import (
	"context"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
)

func TestSnapshotLifecycleAndRestore(t *testing.T) {
	ctx := context.Background()
	s, vols, _ := newTestController(ControllerOptions{})
	for _, name := range []string{"pvc-a", "pvc-b"} {
		if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}}); err != nil {
			t.Fatal(err)
		}
	}
	take := func(name, vol string) *csi.Snapshot {
		t.Helper()
		resp, err := s.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: vol})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetSnapshot()
	}
	snap := take("snapshot-1", "pvc-a")
	if snap.GetSnapshotId() != "snapshot-1" || snap.GetSourceVolumeId() != "pvc-a" || !snap.GetReadyToUse() || snap.GetSizeBytes() != 1<<30 {
		t.Errorf("snapshot %+v", snap)
	}
	if again := take("snapshot-1", "pvc-a"); again.GetSnapshotId() != snap.GetSnapshotId() {
		t.Errorf("retry answered another snapshot %+v", again)
	}
	take("snapshot-2", "pvc-b")
	take("snapshot-3", "pvc-a")

	list := func(req *csi.ListSnapshotsRequest) ([]string, string) {
		t.Helper()
		resp, err := s.ListSnapshots(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, e := range resp.GetEntries() {
			ids = append(ids, e.GetSnapshot().GetSnapshotId())
		}
		return ids, resp.GetNextToken()
	}
	if ids, _ := list(&csi.ListSnapshotsRequest{}); !slices.Equal(ids, []string{"snapshot-1", "snapshot-2", "snapshot-3"}) {
		t.Errorf("all snapshots %v", ids)
	}
	if ids, _ := list(&csi.ListSnapshotsRequest{SourceVolumeId: "pvc-a"}); !slices.Equal(ids, []string{"snapshot-1", "snapshot-3"}) {
		t.Errorf("snapshots of pvc-a %v", ids)
	}
	if ids, _ := list(&csi.ListSnapshotsRequest{SnapshotId: "snapshot-2"}); !slices.Equal(ids, []string{"snapshot-2"}) {
		t.Errorf("snapshot-2 by ID %v", ids)
	}
	if ids, _ := list(&csi.ListSnapshotsRequest{SnapshotId: "nope"}); len(ids) != 0 {
		t.Errorf("unknown ID listed %v", ids)
	}
	ids, next := list(&csi.ListSnapshotsRequest{MaxEntries: 2})
	rest, last := list(&csi.ListSnapshotsRequest{MaxEntries: 2, StartingToken: next})
	if !slices.Equal(append(ids, rest...), []string{"snapshot-1", "snapshot-2", "snapshot-3"}) || last != "" {
		t.Errorf("pages %v then %v (token %q)", ids, rest, last)
	}

	// Restore: same host mode as the source, at least its size.
	resp, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-restored", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		Parameters:          map[string]string{paramHostVolumeMode: "filesystem"},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snapshot-1"}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	spec := vols.created[len(vols.created)-1]
	if spec.FromSnapshot != "snapshot-1" || spec.Mode != corev1.PersistentVolumeBlock || spec.Bytes != 1<<30 || resp.GetVolume().GetContentSource() == nil {
		t.Errorf("restore spec %+v, content source %v", spec, resp.GetVolume().GetContentSource())
	}

	if _, err := s.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "snapshot-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "snapshot-1"}); err != nil {
		t.Errorf("second delete: %v", err)
	}
}

func TestSnapshotBadInput(t *testing.T) {
	ctx := context.Background()
	s, _, _ := newTestController(ControllerOptions{})
	if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: []*csi.VolumeCapability{rwo}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: "pvc-a"}); err != nil {
		t.Fatal(err)
	}
	fromSnap := func(id string) *csi.VolumeContentSource {
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
	}
	for _, tc := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"snapshot without name", func() error {
			_, err := s.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: "pvc-a"})
			return err
		}, codes.InvalidArgument},
		{"snapshot without source", func() error {
			_, err := s.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "x"})
			return err
		}, codes.InvalidArgument},
		{"snapshot of a missing volume", func() error {
			_, err := s.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: "pvc-missing"})
			return err
		}, codes.NotFound},
		{"same name, other volume", func() error {
			_, err := s.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: "pvc-b"})
			return err
		}, codes.AlreadyExists},
		{"unknown snapshot type", func() error {
			_, err := s.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "y", SourceVolumeId: "pvc-a", Parameters: map[string]string{"type": "bak"}})
			return err
		}, codes.InvalidArgument},
		{"delete without ID", func() error {
			_, err := s.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"list with a foreign token", func() error {
			_, err := s.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: "invalid-token"})
			return err
		}, codes.Aborted},
		{"restore from a missing snapshot", func() error {
			_, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "r", VolumeCapabilities: []*csi.VolumeCapability{rwo}, VolumeContentSource: fromSnap("gone")})
			return err
		}, codes.NotFound},
		{"restore with a limit below the smallest volume", func() error {
			_, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "r2", VolumeCapabilities: []*csi.VolumeCapability{rwo}, VolumeContentSource: fromSnap("snap"),
				CapacityRange: &csi.CapacityRange{LimitBytes: 1 << 20}})
			return err
		}, codes.OutOfRange},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(); status.Code(err) != tc.want {
				t.Errorf("answered %v, want %v", err, tc.want)
			}
		})
	}
}
