package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/nodeid"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/sweeper"
)

// PublishContextSerial is the publish_context key under which
// ControllerPublishVolume may pass the disk serial it gave the hotplug; the
// node then finds the disk by serial before trying the upstream name match.
const PublishContextSerial = "serial"

// NodeOptions configures the node service. Zero values take the defaults
// noted on each field.
type NodeOptions struct {
	// NodeID (--nodeid) overrides discovery of the VM name.
	NodeID string
	// Hostname used by discovery (default os.Hostname()).
	Hostname string
	// VMIs lets discovery match MACs against the host's VMIs; nil means the
	// hostname is the node ID unless NodeID is set.
	VMIs nodeid.VMISource
	// SysfsRoot (--sysfs-root, default /sys): MACs under class/net, devices
	// under dev/block.
	SysfsRoot string
	// ByIDDir (--by-id-dir, default /dev/disk/by-id) is where hot-plugged
	// disks are looked up.
	ByIDDir string
	// ProcRoot (default /proc) is scanned for processes holding a device;
	// the DaemonSet runs with hostPID so it sees the whole node.
	ProcRoot string
	// MountInfoPath (default /proc/self/mountinfo) is the mount table.
	MountInfoPath string
	// DeviceWait bounds the wait for a disk to appear (default 15s).
	DeviceWait time.Duration
	// DevicePollInterval is the delay between looks (default 200ms).
	DevicePollInterval time.Duration
	// InUseRechecks and InUseRecheckInterval (defaults 2 and 500ms) decide
	// how long a device holder must persist before NodeUnstageVolume fails.
	InUseRechecks        int
	InUseRecheckInterval time.Duration
	// SweepInterval (--sweep-interval, default 1m) paces the stale staging
	// sweeper started by Run; negative disables it.
	SweepInterval time.Duration
	// SweepConfirm (default 1s) is how long a device must stay gone before
	// its staging mount is swept.
	SweepConfirm time.Duration
	// Events receives an Event when a stale staging mount is removed; nil
	// only logs.
	Events sweeper.EventRecorder
	// MaxVolumesPerNode is reported by NodeGetInfo (0: no limit).
	MaxVolumesPerNode int64
}

// Runner is implemented by the node service returned by NewNodeService:
// Run keeps the stale staging sweeper going until ctx ends.
type Runner interface {
	Run(ctx context.Context)
}

type nodeService struct {
	csi.UnimplementedNodeServer
	opts    NodeOptions
	finder  *device.Finder
	inUse   *device.InUseChecker
	mounter *mounter.Mounter
	sweeper *sweeper.Sweeper
	locks   *volumeLocks

	idMu   sync.Mutex
	nodeID string

	// serials remembers disk serials from publish contexts: NodeUnstage
	// gets no publish context but needs the disk to check it is unused.
	serialMu sync.Mutex
	serials  map[string]string
}

// forget drops what the service remembers about a volume once unstaged.
func (s *nodeService) forget(id, staging string) {
	s.sweeper.Forget(staging)
	s.serialMu.Lock()
	defer s.serialMu.Unlock()
	delete(s.serials, id)
}

func (s *nodeService) serial(id string, publishContext map[string]string) string {
	s.serialMu.Lock()
	defer s.serialMu.Unlock()
	if v := publishContext[PublishContextSerial]; v != "" {
		s.serials[id] = v
	}
	return s.serials[id]
}

// NewNodeService returns the CSI Node service. It also implements Runner.
func NewNodeService(opts NodeOptions) (csi.NodeServer, error) {
	if opts.SysfsRoot == "" {
		opts.SysfsRoot = "/sys"
	}
	if opts.ByIDDir == "" {
		opts.ByIDDir = "/dev/disk/by-id"
	}
	if opts.ProcRoot == "" {
		opts.ProcRoot = "/proc"
	}
	if opts.MountInfoPath == "" {
		opts.MountInfoPath = mountinfo.SelfPath
	}
	s := &nodeService{
		opts: opts,
		finder: device.NewFinder(device.FinderOptions{
			ByIDDir: opts.ByIDDir, SysfsRoot: opts.SysfsRoot, Wait: opts.DeviceWait, PollInterval: opts.DevicePollInterval,
		}),
		inUse: device.NewInUseChecker(device.InUseOptions{
			ProcRoot: opts.ProcRoot, MountInfoPath: opts.MountInfoPath,
			Rechecks: opts.InUseRechecks, RecheckInterval: opts.InUseRecheckInterval,
		}),
		mounter: mounter.New(mounter.Options{MountInfoPath: opts.MountInfoPath}),
		locks:   &volumeLocks{held: map[string]bool{}},
		serials: map[string]string{},
		nodeID:  opts.NodeID,
	}
	sw, err := sweeper.New(sweeper.Options{
		DriverName: Name, Interval: opts.SweepInterval, Confirm: opts.SweepConfirm,
		Finder: s.finder, Mounter: s.mounter, Recorder: opts.Events, TryLock: s.locks.tryLock,
	})
	if err != nil {
		return nil, err
	}
	s.sweeper = sw
	return s, nil
}

// Run runs the stale staging sweeper until ctx ends.
func (s *nodeService) Run(ctx context.Context) {
	if s.opts.SweepInterval < 0 {
		return
	}
	s.sweeper.Run(ctx)
}

// volumeLocks keeps two operations off one volume at a time; a second one
// gets Aborted, as the CSI spec suggests, and the CO retries.
type volumeLocks struct {
	mu   sync.Mutex
	held map[string]bool
}

func (l *volumeLocks) tryLock(id string) (func(), bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held[id] {
		return nil, false
	}
	l.held[id] = true
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(l.held, id)
	}, true
}

func (s *nodeService) lock(id string) (func(), error) {
	release, ok := s.locks.tryLock(id)
	if !ok {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %s is already in progress on this node", id)
	}
	return release, nil
}

// withVolume puts the volume (and the VM, once known) on every log line of
// the call.
func (s *nodeService) withVolume(ctx context.Context, volumeID string) (context.Context, klog.Logger) {
	logger := klog.FromContext(ctx).WithValues("volume", volumeID)
	s.idMu.Lock()
	if s.nodeID != "" {
		logger = logger.WithValues("vm", s.nodeID)
	}
	s.idMu.Unlock()
	return klog.NewContext(ctx, logger), logger
}

func (s *nodeService) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_VOLUME_CONDITION,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (s *nodeService) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	// Discovery is done once: the answer is registered in CSINode and must
	// not change under kubelet's feet.
	s.idMu.Lock()
	defer s.idMu.Unlock()
	if s.nodeID == "" {
		id, err := nodeid.Discover(ctx, nodeid.Options{SysfsRoot: s.opts.SysfsRoot, Hostname: s.opts.Hostname, VMIs: s.opts.VMIs})
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "discover the VM of this node: %v", err)
		}
		s.nodeID = id
		klog.FromContext(ctx).Info("node ID discovered", "vm", id)
	}
	return &csi.NodeGetInfoResponse{NodeId: s.nodeID, MaxVolumesPerNode: s.opts.MaxVolumesPerNode}, nil
}

// checkCapability accepts what one VM's hot-plugged disk can serve: a block
// device or a supported filesystem, on one node.
func checkCapability(c *csi.VolumeCapability) error {
	if c == nil {
		return status.Error(codes.InvalidArgument, "volume capability missing")
	}
	switch c.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
	case csi.VolumeCapability_AccessMode_UNKNOWN:
		return status.Error(codes.InvalidArgument, "volume capability has no access mode")
	default:
		return status.Errorf(codes.InvalidArgument, "access mode %s is not supported on a hot-plugged disk", c.GetAccessMode().GetMode())
	}
	switch {
	case c.GetBlock() != nil:
	case c.GetMount() != nil:
		if fs := c.GetMount().GetFsType(); !mounter.SupportedFSType(fs) {
			return status.Errorf(codes.InvalidArgument, "filesystem type %q is not supported (ext4, ext3, xfs)", fs)
		}
	default:
		return status.Error(codes.InvalidArgument, "volume capability has neither block nor mount access type")
	}
	return nil
}

func readOnlyMode(c *csi.VolumeCapability) bool {
	return c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
}

// toStatus maps errors of the node packages to gRPC codes.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	var inUse *device.InUseError
	var ambiguous *device.AmbiguousError
	var mismatch *mounter.MismatchError
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	case errors.Is(err, device.ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.As(err, &inUse), errors.As(err, &ambiguous), errors.As(err, &mismatch):
		return status.Error(codes.FailedPrecondition, err.Error())
	default:
		return status.Error(codes.Internal, err.Error())
	}
}

func (s *nodeService) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing")
	}
	if staging == "" {
		return nil, status.Error(codes.InvalidArgument, "staging target path missing")
	}
	if err := checkCapability(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	ctx, logger := s.withVolume(ctx, id)
	release, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer release()

	dev, err := s.finder.Wait(ctx, id, s.serial(id, req.GetPublishContext()))
	if err != nil {
		return nil, toStatus(err)
	}
	capability := req.GetVolumeCapability()
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

// checkExistingStaging handles a staging path that is already mounted: the
// same device means a repeated call; a device that is gone means NodeUnstage
// was skipped before the disk was unplugged and re-plugged, so the stale
// mount is lazily removed; any other device is a conflict.
func (s *nodeService) checkExistingStaging(ctx context.Context, id, staging string, dev device.Device) (done bool, err error) {
	logger := klog.FromContext(ctx)
	for i := 0; i < 10; i++ {
		mnt, ok, err := s.mounter.MountAt(staging)
		if err != nil || !ok {
			return false, err
		}
		if mnt.Major == dev.Major && mnt.Minor == dev.Minor {
			if mnt.Root != "/" {
				return false, status.Errorf(codes.AlreadyExists, "staging path %s has a bind mount of %s on it, not the volume", staging, mnt.Root)
			}
			s.sweeper.Track(id, staging)
			logger.V(2).Info("volume already staged", "device", dev.Path, "path", staging)
			return true, nil
		}
		old := device.Device{Path: mnt.Source, Major: mnt.Major, Minor: mnt.Minor}
		present, reason, err := s.finder.Present(old)
		if err != nil {
			return false, err
		}
		if present {
			return false, status.Errorf(codes.AlreadyExists, "staging path %s already has %s mounted, not the volume's disk %s", staging, old, dev)
		}
		if err := s.mounter.Detach(ctx, staging); err != nil {
			return false, err
		}
		msg := fmt.Sprintf("removed stale staging mount %s of volume %s before staging it again: its old disk %s is gone (%s) and NodeUnstageVolume was never called",
			staging, id, mnt.Source, reason)
		logger.Info("removed stale staging mount before staging again", "path", staging, "oldDevice", mnt.Source, "reason", reason)
		if s.opts.Events != nil {
			s.opts.Events.Event(ctx, id, sweeper.EventTypeWarning, sweeper.ReasonStaleStagingRemoved, msg)
		}
	}
	return false, status.Errorf(codes.Internal, "staging path %s still has mounts after removing stale ones", staging)
}

func (s *nodeService) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing")
	}
	if staging == "" {
		return nil, status.Error(codes.InvalidArgument, "staging target path missing")
	}
	ctx, logger := s.withVolume(ctx, id)
	release, err := s.lock(id)
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
		dev, err := s.finder.Lookup(id, s.serial(id, nil))
		switch {
		case errors.Is(err, device.ErrNotFound):
		case err != nil:
			logger.Error(err, "cannot identify the disk to check it is unused; nothing of it is staged here")
		default:
			if err := s.inUse.Check(ctx, dev); err != nil {
				return nil, toStatus(err)
			}
		}
		s.forget(id, staging)
		logger.V(2).Info("nothing staged", "path", staging)
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
	s.forget(id, staging)
	logger.Info("volume unstaged", "device", dev.Path, "path", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (s *nodeService) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, target, staging := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing")
	}
	if target == "" {
		return nil, status.Error(codes.InvalidArgument, "target path missing")
	}
	if err := checkCapability(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	if staging == "" {
		return nil, status.Error(codes.InvalidArgument, "staging target path missing (this driver stages volumes)")
	}
	ctx, logger := s.withVolume(ctx, id)
	release, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer release()

	capability := req.GetVolumeCapability()
	readOnly := req.GetReadonly() || readOnlyMode(capability)
	if capability.GetBlock() != nil {
		dev, err := s.finder.Wait(ctx, id, s.serial(id, req.GetPublishContext()))
		if err != nil {
			return nil, toStatus(err)
		}
		if done, err := s.checkExistingPublish(target, dev, readOnly); err != nil || done {
			return &csi.NodePublishVolumeResponse{}, err
		}
		if err := mounter.EnsureFile(target); err != nil {
			return nil, toStatus(err)
		}
		if err := s.mounter.BindMount(ctx, dev.Path, target, readOnly, nil); err != nil {
			return nil, toStatus(err)
		}
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
		dev, err := s.finder.Wait(ctx, id, s.serial(id, req.GetPublishContext()))
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
	if done, err := s.checkExistingPublish(target, stagedDev, readOnly); err != nil || done {
		return &csi.NodePublishVolumeResponse{}, err
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, toStatus(err)
	}
	if err := s.mounter.BindMount(ctx, staging, target, readOnly, capability.GetMount().GetMountFlags()); err != nil {
		return nil, toStatus(err)
	}
	logger.Info("volume published", "device", stagedDev.Path, "target", target, "readOnly", readOnly)
	return &csi.NodePublishVolumeResponse{}, nil
}

// checkExistingPublish makes a repeated publish succeed and a conflicting one
// fail with AlreadyExists.
func (s *nodeService) checkExistingPublish(target string, dev device.Device, readOnly bool) (bool, error) {
	mnt, ok, err := s.mounter.MountAt(target)
	if err != nil || !ok {
		return false, toStatus(err)
	}
	same := mnt.Major == dev.Major && mnt.Minor == dev.Minor
	if !same {
		// A block-mode target is a bind of the device node, on devtmpfs.
		if o, err := device.FromPath(target); err == nil && o.Same(dev) {
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

func hasMountOption(options, o string) bool {
	for _, x := range strings.Split(options, ",") {
		if x == o {
			return true
		}
	}
	return false
}

func (s *nodeService) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing")
	}
	if target == "" {
		return nil, status.Error(codes.InvalidArgument, "target path missing")
	}
	ctx, logger := s.withVolume(ctx, id)
	release, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer release()
	// The same for our bind mounts and for upstream's direct mounts of the
	// disk onto the target: unmount whatever is there, then remove the path.
	if err := s.mounter.Unmount(ctx, target); err != nil {
		return nil, toStatus(err)
	}
	if err := s.mounter.RemovePath(target); err != nil {
		return nil, toStatus(err)
	}
	logger.Info("volume unpublished", "target", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (s *nodeService) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing")
	}
	if path == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path missing")
	}
	ctx, _ = s.withVolume(ctx, id)
	if _, err := os.Stat(path); err != nil {
		if os.IsNotExist(err) {
			return nil, status.Errorf(codes.NotFound, "volume %s: path %s does not exist", id, path)
		}
		return nil, toStatus(err)
	}
	if dev, err := device.FromPath(path); err == nil {
		size, err := mounter.DeviceSize(path)
		if err != nil {
			return nil, toStatus(err)
		}
		return &csi.NodeGetVolumeStatsResponse{
			Usage:           []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}},
			VolumeCondition: s.condition(ctx, dev),
		}, nil
	}
	mnt, ok, err := s.mounter.MountAt(path)
	if err != nil {
		return nil, toStatus(err)
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s is not mounted at %s", id, path)
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
		VolumeCondition: s.condition(ctx, device.Device{Path: mnt.Source, Major: mnt.Major, Minor: mnt.Minor}),
	}, nil
}

func (s *nodeService) condition(ctx context.Context, dev device.Device) *csi.VolumeCondition {
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

func (s *nodeService) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID missing")
	}
	if path == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path missing")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapability(c); err != nil {
			return nil, err
		}
	}
	ctx, logger := s.withVolume(ctx, id)
	if _, err := os.Stat(path); err != nil {
		if os.IsNotExist(err) {
			return nil, status.Errorf(codes.NotFound, "volume %s: path %s does not exist", id, path)
		}
		return nil, toStatus(err)
	}
	release, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer release()
	required := req.GetCapacityRange().GetRequiredBytes()

	if dev, err := device.FromPath(path); err == nil {
		// Block: the guest sees the new size once the disk grew; nothing to
		// resize on top.
		size, err := s.deviceSize(ctx, dev)
		if err != nil {
			return nil, toStatus(err)
		}
		if required > 0 && size < required {
			return nil, status.Errorf(codes.FailedPrecondition, "disk %s is %d bytes, less than the requested %d: it has not grown on this node yet", dev.Path, size, required)
		}
		logger.Info("block volume size checked after expansion", "device", dev.Path, "bytes", size)
		return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
	}
	mnt, ok, err := s.mounter.MountAt(path)
	if err != nil {
		return nil, toStatus(err)
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s is not mounted at %s", id, path)
	}
	dev, err := s.mountDevice(id, mnt)
	if err != nil {
		return nil, toStatus(err)
	}
	size, err := s.deviceSize(ctx, dev)
	if err != nil {
		return nil, toStatus(err)
	}
	if required > 0 && size < required {
		return nil, status.Errorf(codes.FailedPrecondition, "disk %s is %d bytes, less than the requested %d: it has not grown on this node yet", dev.Path, size, required)
	}
	if err := s.mounter.Resize(ctx, dev.Path, path); err != nil {
		return nil, toStatus(err)
	}
	logger.Info("volume expanded", "device", dev.Path, "path", path, "bytes", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// mountDevice returns the device node of a mounted filesystem: the mount's
// source when that is the device, else the disk found by volume ID.
func (s *nodeService) mountDevice(id string, mnt mountinfo.Mount) (device.Device, error) {
	if d, err := device.FromPath(mnt.Source); err == nil && d.Major == mnt.Major && d.Minor == mnt.Minor {
		return d, nil
	}
	d, err := s.finder.Lookup(id, "")
	if err != nil {
		return device.Device{}, err
	}
	if d.Major != mnt.Major || d.Minor != mnt.Minor {
		return device.Device{}, fmt.Errorf("the mounted filesystem (%d:%d) is not on the volume's disk %s", mnt.Major, mnt.Minor, d)
	}
	return d, nil
}

// deviceSize asks the kernel to re-read the disk's capacity where it can
// (SCSI rescan) and returns the size the device reports.
func (s *nodeService) deviceSize(ctx context.Context, dev device.Device) (int64, error) {
	rescan := fmt.Sprintf("%s/dev/block/%d:%d/device/rescan", s.opts.SysfsRoot, dev.Major, dev.Minor)
	if f, err := os.OpenFile(rescan, os.O_WRONLY, 0); err == nil {
		if _, err := f.WriteString("1"); err != nil {
			klog.FromContext(ctx).V(2).Info("disk rescan failed", "device", dev.Path, "err", err)
		}
		_ = f.Close()
	}
	return mounter.DeviceSize(dev.Path)
}

// Compile-time check that the service offers Runner.
var _ Runner = (*nodeService)(nil)
