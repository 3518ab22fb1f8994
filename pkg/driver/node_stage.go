package driver

import (
	"context"
	"errors"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
)

func (s *NodeService) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id, staging, capability := req.GetVolumeId(), req.GetStagingTargetPath(), req.GetVolumeCapability()
	ctx, logger, release, err := s.begin(ctx, nodeRequest{volumeID: id,
		paths: []namedPath{{"staging target path", staging}}, capability: capability, needCapability: true})
	if err != nil {
		return nil, err
	}
	defer release()

	if multiNode(capability) {
		if err := s.stageNFS(ctx, id, staging, capability, req.GetPublishContext()); err != nil {
			return nil, err
		}
		return &csi.NodeStageVolumeResponse{}, nil
	}
	dev, err := s.waitDisk(ctx, id)
	if err != nil {
		return nil, toStatus(err)
	}
	if capability.GetBlock() != nil {
		// A raw block volume is used through the device node itself; the
		// wait above is what staging means for it.
		logger.V(2).Info("block volume staged", "device", dev.Path)
		return &csi.NodeStageVolumeResponse{}, nil
	}

	done, err := s.checkExistingStaging(ctx, id, staging, dev)
	if err != nil || done {
		return &csi.NodeStageVolumeResponse{}, toStatus(err)
	}
	options := append([]string{}, capability.GetMount().GetMountFlags()...)
	if readOnlyMode(capability) {
		options = append(options, "ro")
	}
	formatted, err := s.mounter.FormatAndMount(ctx, dev.Path, staging, capability.GetMount().GetFsType(), options)
	if err != nil {
		return nil, toStatus(err)
	}
	s.sweeper.Track(id, staging)
	logger.Info("volume staged", "device", dev.Path, "path", staging, "formatted", formatted)
	return &csi.NodeStageVolumeResponse{}, nil
}

// checkExistingStaging handles a staging path that is already mounted. Mounts
// whose disk is gone are stale (NodeUnstage was skipped before the disk was
// unplugged and plugged again) and are removed as the sweeper would; then the
// same device means a repeated call, and anything else is a conflict.
func (s *NodeService) checkExistingStaging(ctx context.Context, id, staging string, dev device.Device) (done bool, err error) {
	if _, _, err := s.sweeper.RemoveStale(ctx, id, staging, "before staging it again"); err != nil {
		return false, err
	}
	mnt, ok, err := s.mounter.MountAt(staging)
	if err != nil || !ok {
		return false, err
	}
	if mnt.Major != dev.Major || mnt.Minor != dev.Minor {
		return false, status.Errorf(codes.AlreadyExists, "staging path %s already has %s (%s, %d:%d) mounted, not the volume's disk %s",
			staging, mnt.Source, mnt.FSType, mnt.Major, mnt.Minor, dev)
	}
	if mnt.Root != "/" {
		return false, status.Errorf(codes.AlreadyExists, "staging path %s has a bind mount of %s on it, not the volume", staging, mnt.Root)
	}
	s.sweeper.Track(id, staging)
	klog.FromContext(ctx).V(2).Info("volume already staged", "device", dev.Path, "path", staging)
	return true, nil
}

func (s *NodeService) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	ctx, logger, release, err := s.begin(ctx, nodeRequest{volumeID: id, paths: []namedPath{{"staging target path", staging}}})
	if err != nil {
		return nil, err
	}
	defer release()

	mnt, mounted, err := s.mounter.MountAt(staging)
	if err != nil {
		return nil, toStatus(err)
	}
	if !mounted {
		// A block volume, a volume upstream mounted straight onto its target
		// path, or a repeated call. The disk may still be held by someone;
		// detaching it then would pull it from under them.
		dev, err := s.finder.Lookup(id)
		switch {
		case errors.Is(err, device.ErrNotFound):
		case err != nil:
			logger.Error(err, "cannot identify the disk to check it is unused; nothing of it is staged here")
		default:
			if err := s.inUse.Check(ctx, dev); err != nil {
				return nil, toStatus(err)
			}
		}
		s.sweeper.Forget(staging)
		logger.V(2).Info("nothing staged", "path", staging)
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if mounter.IsNFS(mnt.FSType) {
		if err := s.unstageNFS(ctx, staging, mnt.Source); err != nil {
			return nil, err
		}
		return &csi.NodeUnstageVolumeResponse{}, nil
	}

	dev := device.Device{Path: mnt.Source, Major: mnt.Major, Minor: mnt.Minor}
	present, reason, err := s.finder.Present(dev)
	if err != nil {
		return nil, toStatus(err)
	}
	if present {
		if err := s.inUse.Check(ctx, dev, staging); err != nil {
			return nil, toStatus(err)
		}
		if err := s.mounter.Unmount(ctx, staging); err != nil {
			return nil, toStatus(err)
		}
	} else {
		// The disk went away under the mount; nobody can write to it any
		// more and a plain unmount may fail on the dead filesystem.
		logger.Info("disk already gone; unmounting lazily", "device", dev.Path, "reason", reason)
		if err := s.mounter.Unmount(ctx, staging); err != nil {
			if err := s.mounter.LazyUnmount(ctx, staging); err != nil {
				return nil, toStatus(err)
			}
		}
	}
	s.sweeper.Forget(staging)
	logger.Info("volume unstaged", "device", dev.Path, "path", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}
