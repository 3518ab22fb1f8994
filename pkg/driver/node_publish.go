package driver

import (
	"context"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
)

func (s *NodeService) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, target, staging, capability := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath(), req.GetVolumeCapability()
	ctx, logger, release, err := s.begin(ctx, nodeRequest{volumeID: id,
		paths:      []namedPath{{"target path", target}, {"staging target path", staging}},
		capability: capability, needCapability: true})
	if err != nil {
		return nil, err
	}
	defer release()

	readOnly := req.GetReadonly() || readOnlyMode(capability)
	if multiNode(capability) {
		if err := s.publishNFS(ctx, id, staging, target, capability, readOnly); err != nil {
			return nil, err
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if capability.GetBlock() != nil {
		dev, err := s.waitDisk(ctx, id)
		if err != nil {
			return nil, toStatus(err)
		}
		if done, err := s.checkExistingPublish(target, dev, readOnly); err != nil || done {
			return &csi.NodePublishVolumeResponse{}, err
		}
		if err := s.checkSingleWriter(id, target, capability); err != nil {
			return nil, err
		}
		if err := mounter.EnsureFile(target); err != nil {
			return nil, toStatus(err)
		}
		if err := s.mounter.BindMount(ctx, dev.Path, target, readOnly, nil); err != nil {
			return nil, toStatus(err)
		}
		s.published.add(id, target)
		logger.Info("block volume published", "device", dev.Path, "target", target, "readOnly", readOnly)
		return &csi.NodePublishVolumeResponse{}, nil
	}

	stagedMnt, staged, err := s.mounter.MountAt(staging)
	if err != nil {
		return nil, toStatus(err)
	}
	if !staged {
		// An upgraded node: upstream never mounted the staging path, so a
		// volume it published is mounted only on its old target. Stage it
		// now; mounting the same filesystem a second time shares it.
		logger.Info("staging path not mounted; staging the volume first", "path", staging)
		dev, err := s.waitDisk(ctx, id)
		if err != nil {
			return nil, toStatus(err)
		}
		if _, err := s.mounter.FormatAndMount(ctx, dev.Path, staging, capability.GetMount().GetFsType(), capability.GetMount().GetMountFlags()); err != nil {
			return nil, toStatus(err)
		}
		s.sweeper.Track(id, staging)
		if stagedMnt, _, err = s.mounter.MountAt(staging); err != nil {
			return nil, toStatus(err)
		}
	}
	stagedDev := device.Device{Path: stagedMnt.Source, Major: stagedMnt.Major, Minor: stagedMnt.Minor}
	// Whatever is at the staging path goes into the pod: it must be this
	// volume's disk.
	if disk, err := s.finder.Lookup(id); err != nil {
		return nil, toStatus(err)
	} else if !disk.Same(stagedDev) {
		return nil, status.Errorf(codes.FailedPrecondition, "staging path %s has %s mounted, not the volume's disk %s", staging, stagedDev, disk)
	}
	if done, err := s.checkExistingPublish(target, stagedDev, readOnly); err != nil || done {
		return &csi.NodePublishVolumeResponse{}, err
	}
	if err := s.checkSingleWriter(id, target, capability); err != nil {
		return nil, err
	}
	if err := mounter.EnsureDir(target); err != nil {
		return nil, toStatus(err)
	}
	if err := s.mounter.BindMount(ctx, staging, target, readOnly, capability.GetMount().GetMountFlags()); err != nil {
		return nil, toStatus(err)
	}
	s.published.add(id, target)
	logger.Info("volume published", "device", stagedDev.Path, "target", target, "readOnly", readOnly)
	return &csi.NodePublishVolumeResponse{}, nil
}

// checkExistingPublish makes a repeated publish succeed and a conflicting one
// fail with AlreadyExists.
func (s *NodeService) checkExistingPublish(target string, dev device.Device, readOnly bool) (bool, error) {
	mnt, ok, err := s.mounter.MountAt(target)
	if err != nil || !ok {
		return false, toStatus(err)
	}
	same := mnt.Major == dev.Major && mnt.Minor == dev.Minor
	if !same {
		// A block-mode target is a bind of the device node, on devtmpfs.
		if o, err := device.FromPathNoFollow(target); err == nil && o.Same(dev) {
			same = true
		}
	}
	if !same {
		return false, status.Errorf(codes.AlreadyExists, "target %s already has something else mounted (%s)", target, mnt.Source)
	}
	if isRO := hasMountOption(mnt.Options, "ro"); isRO != readOnly {
		return false, status.Errorf(codes.AlreadyExists, "target %s is already published with read-only=%t", target, isRO)
	}
	return true, nil
}

// checkSingleWriter refuses a second target of a SINGLE_NODE_SINGLE_WRITER
// (ReadWriteOncePod) volume on this node, as the CSI spec's table for
// plugins with the SINGLE_NODE_MULTI_WRITER capability says
// (FAILED_PRECONDITION). Kubernetes already keeps a second pod of such a
// claim off every node (the scheduler's VolumeRestrictions plugin); this is
// the node's own word on it. The targets are those this process published
// and that are still mounted.
func (s *NodeService) checkSingleWriter(id, target string, c *csi.VolumeCapability) error {
	if c.GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		return nil
	}
	for _, other := range s.published.pathsOf(id) {
		if other == mountinfo.Canonical(target) {
			continue
		}
		if mounted, err := s.mounter.IsMountPoint(other); err != nil {
			return toStatus(err)
		} else if mounted {
			return status.Errorf(codes.FailedPrecondition, "volume %s is SINGLE_NODE_SINGLE_WRITER (ReadWriteOncePod) and already published at %s on this node", id, other)
		}
	}
	return nil
}

func hasMountOption(options, o string) bool {
	for _, x := range strings.Split(options, ",") {
		if x == o {
			return true
		}
	}
	return false
}

func (s *NodeService) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	ctx, logger, release, err := s.begin(ctx, nodeRequest{volumeID: id, paths: []namedPath{{"target path", target}}})
	if err != nil {
		return nil, err
	}
	defer release()
	// The same for our bind mounts and for upstream's direct mounts of the
	// disk onto the target: unmount whatever is mounted at the path itself
	// (never through a symlink there), then remove the path.
	if err := s.mounter.Unmount(ctx, target); err != nil {
		return nil, toStatus(err)
	}
	if err := s.mounter.RemovePath(target); err != nil {
		return nil, toStatus(err)
	}
	s.published.remove(target)
	logger.Info("volume unpublished", "target", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}
