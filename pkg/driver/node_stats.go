package driver

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
)

func (s *NodeService) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if err := (nodeRequest{volumeID: id}).validate(); err != nil {
		return nil, err
	}
	if path == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path missing")
	}
	ctx, _ = s.withVolume(ctx, id)
	if resp, handled, err := s.nfsVolumeStats(ctx, id, path); handled {
		return resp, err
	}
	v, err := s.volumeAt(id, path, true)
	if err != nil {
		return nil, err
	}
	condition := s.condition(ctx, v.dev)
	if v.block {
		size, err := mounter.DeviceSize(path)
		if err != nil {
			return nil, toStatus(err)
		}
		return &csi.NodeGetVolumeStatsResponse{
			Usage:           []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}},
			VolumeCondition: condition,
		}, nil
	}
	st, err := mounter.FSStats(path)
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.NodeGetVolumeStatsResponse{
		Usage: []*csi.VolumeUsage{
			{Unit: csi.VolumeUsage_BYTES, Total: st.TotalBytes, Available: st.AvailableBytes, Used: st.UsedBytes},
			{Unit: csi.VolumeUsage_INODES, Total: st.TotalInodes, Available: st.FreeInodes, Used: st.UsedInodes},
		},
		VolumeCondition: condition,
	}, nil
}

// volumeMount is what is mounted at a volume path of a request.
type volumeMount struct {
	// dev is the device mounted there (the device node bound there, for a
	// block volume).
	dev   device.Device
	block bool
	// disk is the volume's disk found by its by-id name, unless gone.
	disk device.Device
}

// volumeAt answers NotFound unless path itself (never through a symlink) has
// a mount of volumeID's disk. A mount whose disk is gone still counts when
// allowGone is set and the path is one this driver staged or published for
// the volume, so its condition can say the disk is gone.
func (s *NodeService) volumeAt(volumeID, path string, allowGone bool) (volumeMount, error) {
	notFound := func(format string, a ...any) error {
		return status.Errorf(codes.NotFound, "volume %s is not at %s: %s", volumeID, path, fmt.Sprintf(format, a...))
	}
	if !cleanAbs(path) {
		return volumeMount{}, notFound("not an absolute path in clean form")
	}
	if _, err := os.Lstat(path); err != nil {
		if os.IsNotExist(err) {
			return volumeMount{}, notFound("the path does not exist")
		}
		return volumeMount{}, toStatus(err)
	}
	mnt, ok, err := s.mounter.MountAt(path)
	if err != nil {
		return volumeMount{}, toStatus(err)
	}
	if !ok {
		return volumeMount{}, notFound("nothing is mounted there")
	}
	var v volumeMount
	if d, err := device.FromPathNoFollow(path); err == nil {
		v.dev, v.block = d, true // a block volume: the device node bound onto a file
	} else {
		v.dev = device.Device{Path: mnt.Source, Major: mnt.Major, Minor: mnt.Minor}
	}
	disk, err := s.finder.Lookup(volumeID)
	switch {
	case err == nil && disk.Same(v.dev):
		v.disk = disk
		return v, nil
	case err != nil && !errors.Is(err, device.ErrNotFound):
		return volumeMount{}, toStatus(err)
	}
	if allowGone && s.ownedBy(volumeID, path) {
		if present, _, err := s.finder.Present(v.dev); err == nil && !present {
			return v, nil
		}
	}
	return volumeMount{}, notFound("%s (%s) is mounted there, not the volume's disk", v.dev, mnt.FSType)
}

// ownedBy reports whether this driver staged or published path for volumeID.
func (s *NodeService) ownedBy(volumeID, path string) bool {
	if vol, ok := s.published.owner(path); ok && vol == volumeID {
		return true
	}
	vol, ok := s.sweeper.Owner(path)
	return ok && vol == volumeID
}

func (s *NodeService) condition(ctx context.Context, dev device.Device) *csi.VolumeCondition {
	present, reason, err := s.finder.Present(dev)
	switch {
	case err != nil:
		klog.FromContext(ctx).Error(err, "cannot tell whether the disk is present", "device", dev.Path)
		return &csi.VolumeCondition{Message: "disk state unknown: " + err.Error()}
	case !present:
		return &csi.VolumeCondition{Abnormal: true, Message: fmt.Sprintf("the disk %s is gone from this node: %s", dev.Path, reason)}
	}
	return &csi.VolumeCondition{Message: "disk attached"}
}
