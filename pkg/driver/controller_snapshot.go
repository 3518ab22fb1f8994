package driver

import (
	"context"
	"errors"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// paramSnapshotType is the VolumeSnapshotClass parameter upstream reads:
// "backup" asks for a Harvester backup instead of a Longhorn snapshot.
const paramSnapshotType = "type"

// CreateSnapshot takes a host VolumeSnapshot of the volume's host PVC. The
// snapshot ID is the host snapshot's name; the snapshotter calls again until
// the answer says ready.
func (s *controllerService) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot name is required")
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "source volume ID is required")
	}
	if !validObjectName(req.GetSourceVolumeId()) {
		return nil, notAVolume(req.GetSourceVolumeId())
	}
	t := req.GetParameters()[paramSnapshotType]
	if t != "" && t != "snapshot" && t != snapshotTypeBackup {
		return nil, status.Errorf(codes.InvalidArgument, "snapshot class parameter type %q is not supported: use %q for a Harvester backup, or leave it unset for a host snapshot", t, snapshotTypeBackup)
	}
	// A host snapshot and a backup share one name space on the host: calls
	// of this process for one name go one at a time, so the second sees
	// what the first made (another process is settled on the host, see
	// pkg/host CreateBackup).
	release, err := s.snapNames.lock(ctx, hostPVCName(req.GetName()))
	if err != nil {
		return nil, status.Errorf(codes.Aborted, "snapshot %s: another call for that name is still in progress: %v", req.GetName(), err)
	}
	defer release()
	if t == snapshotTypeBackup {
		return s.createBackup(ctx, req)
	}
	snap, err := s.volumes.CreateSnapshot(ctx, hostPVCName(req.GetName()), req.GetSourceVolumeId())
	var mismatch *host.SnapshotMismatchError
	var taken *host.BackupMismatchError
	switch {
	case errors.As(err, &mismatch), errors.As(err, &taken):
		return nil, status.Error(codes.AlreadyExists, err.Error())
	case err != nil:
		return nil, apiStatus(err, "snapshot volume %s", req.GetSourceVolumeId())
	case !snap.ReadyToUse && snap.Error != "":
		// Said as an error, so it shows on the VolumeSnapshotContent; the
		// snapshotter retries and the host may still get there.
		return nil, status.Errorf(codes.Unavailable, "host snapshot %s is not ready: %s", snap.Name, snap.Error)
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(snap)}, nil
}

// DeleteSnapshot deletes the host snapshot; a missing one is deleted already.
func (s *controllerService) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if req.GetSnapshotId() == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot ID is required")
	}
	if isBackupID(req.GetSnapshotId()) {
		return s.deleteBackup(ctx, req.GetSnapshotId())
	}
	if !validObjectName(req.GetSnapshotId()) {
		return &csi.DeleteSnapshotResponse{}, nil // no host snapshot can have that name
	}
	if err := s.volumes.DeleteSnapshot(ctx, req.GetSnapshotId()); err != nil {
		return nil, apiStatus(err, "delete host snapshot %s", req.GetSnapshotId())
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots lists this driver's host snapshots and backups, optionally
// one by ID or those of one volume, in pages like ListVolumes.
func (s *controllerService) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	after, err := pageStart(req.GetMaxEntries(), req.GetStartingToken())
	if err != nil {
		return nil, err
	}
	id := req.GetSnapshotId()
	var snaps []*csi.Snapshot
	if id == "" || !isBackupID(id) {
		all, err := s.volumes.ListSnapshots(ctx)
		if err != nil {
			return nil, apiStatus(err, "list host snapshots")
		}
		for i := range all {
			snaps = append(snaps, csiSnapshot(&all[i]))
		}
	}
	if id == "" || isBackupID(id) {
		backups, err := s.listBackups(ctx, id)
		if err != nil {
			return nil, err
		}
		snaps = append(snaps, backups...)
	}
	snaps = slices.DeleteFunc(snaps, func(sn *csi.Snapshot) bool {
		return (id != "" && sn.GetSnapshotId() != id) || (req.GetSourceVolumeId() != "" && sn.GetSourceVolumeId() != req.GetSourceVolumeId())
	})
	slices.SortFunc(snaps, func(a, b *csi.Snapshot) int { return strings.Compare(a.GetSnapshotId(), b.GetSnapshotId()) })
	ids := make([]string, len(snaps))
	for i, sn := range snaps {
		ids[i] = sn.GetSnapshotId()
	}
	start, end, next := page(ids, after, req.GetMaxEntries())
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, sn := range snaps[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: sn})
	}
	return resp, nil
}

func csiSnapshot(sn *host.Snapshot) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:     sn.Name,
		SourceVolumeId: sn.SourceVolume,
		CreationTime:   timestamppb.New(sn.CreationTime),
		ReadyToUse:     sn.ReadyToUse,
		SizeBytes:      sn.RestoreBytes,
	}
}

// restoreSource checks a CreateVolume snapshot source and returns the host
// snapshot; the restored PVC takes the source's class and volume mode.
func (s *controllerService) restoreSource(ctx context.Context, src *csi.VolumeContentSource) (*host.Snapshot, error) {
	id := src.GetSnapshot().GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume content source has no snapshot ID")
	}
	if !validObjectName(id) {
		return nil, status.Errorf(codes.NotFound, "snapshot %q does not exist: not a valid host snapshot name", id)
	}
	snap, err := s.volumes.GetSnapshot(ctx, id)
	if apierrors.IsNotFound(err) {
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", id)
	}
	if err != nil {
		return nil, apiStatus(err, "read host snapshot %s", id)
	}
	return snap, nil
}
