package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func (s *NodeService) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if err := (nodeRequest{volumeID: id, capability: req.GetVolumeCapability()}).validate(); err != nil {
		return nil, err
	}
	if path == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path missing")
	}
	ctx, logger := s.withVolume(ctx, id)
	// Only the volume's own disk is ever grown: a path with another
	// filesystem (the root one, say) is NotFound.
	v, err := s.volumeAt(id, path, false)
	if err != nil {
		return nil, err
	}
	release, err := s.locks.lock(id)
	if err != nil {
		return nil, err
	}
	defer release()
	required := req.GetCapacityRange().GetRequiredBytes()
	size, err := s.deviceSize(ctx, v.disk)
	if err != nil {
		return nil, toStatus(err)
	}
	if required > 0 && size < required {
		return nil, status.Errorf(codes.FailedPrecondition, "disk %s is %d bytes, less than the requested %d: it has not grown on this node yet", v.disk.Path, size, required)
	}
	if v.block {
		// Block: the guest sees the new size once the disk grew; nothing to
		// resize on top.
		logger.Info("block volume size checked after expansion", "device", v.disk.Path, "bytes", size)
		return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
	}
	if err := s.mounter.Resize(ctx, v.disk.Path, path); err != nil {
		return nil, toStatus(err)
	}
	logger.Info("volume expanded", "device", v.disk.Path, "path", path, "bytes", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}
