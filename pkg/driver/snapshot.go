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
	if t := req.GetParameters()[paramSnapshotType]; t != "" && t != "snapshot" {
		return nil, status.Errorf(codes.InvalidArgument, "snapshot type %q is not supported yet (only Longhorn snapshots)", t)
	}
	snap, err := s.volumes.CreateSnapshot(ctx, hostPVCName(req.GetName()), req.GetSourceVolumeId())
	var mismatch *host.SnapshotMismatchError
	switch {
	case errors.As(err, &mismatch):
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
	if !validObjectName(req.GetSnapshotId()) {
		return &csi.DeleteSnapshotResponse{}, nil // no host snapshot can have that name
	}
	if err := s.volumes.DeleteSnapshot(ctx, req.GetSnapshotId()); err != nil {
		return nil, apiStatus(err, "delete host snapshot %s", req.GetSnapshotId())
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots lists this driver's host snapshots, optionally one by ID or
// those of one volume, in pages like ListVolumes.
func (s *controllerService) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	after, err := pageStart(req.GetMaxEntries(), req.GetStartingToken())
	if err != nil {
		return nil, err
	}
	all, err := s.volumes.ListSnapshots(ctx)
	if err != nil {
		return nil, apiStatus(err, "list host snapshots")
	}
	var snaps []*host.Snapshot
	for i := range all {
		sn := &all[i]
		if (req.GetSnapshotId() == "" || sn.Name == req.GetSnapshotId()) &&
			(req.GetSourceVolumeId() == "" || sn.SourceVolume == req.GetSourceVolumeId()) {
			snaps = append(snaps, sn)
		}
	}
	slices.SortFunc(snaps, func(a, b *host.Snapshot) int { return strings.Compare(a.Name, b.Name) })
	ids := make([]string, len(snaps))
	for i, sn := range snaps {
		ids[i] = sn.Name
	}
	start, end, next := page(ids, after, req.GetMaxEntries())
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, sn := range snaps[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(sn)})
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
	if src.GetVolume() != nil {
		return nil, status.Error(codes.InvalidArgument, "cloning a volume is not supported")
	}
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
