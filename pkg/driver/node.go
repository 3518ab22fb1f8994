package driver

import (
	"cmp"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/nodeid"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/sweeper"
)

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
	// SysfsRoot (--sysfs-root, default device.DefaultSysfsRoot): MACs under
	// class/net, devices under dev/block.
	SysfsRoot string
	// ByIDDir (--by-id-dir, default device.DefaultByIDDir) is where
	// hot-plugged disks are looked up.
	ByIDDir string
	// KubeletRoot (--kubelet-root-dir, default sweeper.DefaultKubeletRoot)
	// bounds what the stale staging sweeper may touch.
	KubeletRoot string
	// ProcRoot (default /proc) is scanned for processes holding a device;
	// the DaemonSet runs with hostPID so it sees the whole node.
	ProcRoot string
	// MountInfoPath (default /proc/self/mountinfo) is the mount table.
	MountInfoPath string
	// DeviceWait bounds the wait for a disk to appear. By default a stage
	// or publish waits as long as its caller allows (less a margin to
	// answer in), at most 2 minutes.
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
	// MaxVolumesPerNode (--max-volumes-per-node) caps what NodeGetInfo
	// reports, which is otherwise the room KubeVirt's disk limit leaves on
	// the VM (0: no cap).
	MaxVolumesPerNode int64
	// Exports, when set, tells where an RWX volume's NFS export is served
	// when the publish context does not (a VolumeAttachment that upstream
	// attached carries none).
	Exports NFSExports
}

// NFSExports finds a volume's NFS export on the host (pkg/host.Client).
type NFSExports interface {
	NFSExport(ctx context.Context, volume string) (endpoint, export, mountOpts string, err error)
}

// NodeService is the CSI Node service. Run keeps the stale staging sweeper
// going until ctx ends.
type NodeService struct {
	csi.UnimplementedNodeServer
	opts    NodeOptions
	finder  *device.Finder
	inUse   *device.InUseChecker
	mounter *mounter.Mounter
	sweeper *sweeper.Sweeper
	locks   *volumeLocks
	// published remembers the targets this process published, so that
	// NodeGetVolumeStats can still vouch for one whose disk is gone.
	published *pathBook

	idMu   sync.Mutex
	nodeID string
}

// NewNodeService returns the CSI Node service.
func NewNodeService(opts NodeOptions) (*NodeService, error) {
	if opts.SysfsRoot == "" {
		opts.SysfsRoot = device.DefaultSysfsRoot
	}
	if opts.ByIDDir == "" {
		opts.ByIDDir = device.DefaultByIDDir
	}
	if opts.MountInfoPath == "" {
		opts.MountInfoPath = mountinfo.SelfPath
	}
	s := &NodeService{
		opts: opts,
		finder: device.NewFinder(device.FinderOptions{
			// waitDisk bounds each wait by the call's deadline.
			ByIDDir: opts.ByIDDir, SysfsRoot: opts.SysfsRoot, Wait: cmp.Or(opts.DeviceWait, maxDeviceWait), PollInterval: opts.DevicePollInterval,
		}),
		inUse: device.NewInUseChecker(device.InUseOptions{
			ProcRoot: opts.ProcRoot, MountInfoPath: opts.MountInfoPath,
			Rechecks: opts.InUseRechecks, RecheckInterval: opts.InUseRecheckInterval,
		}),
		mounter:   mounter.New(mounter.Options{MountInfoPath: opts.MountInfoPath}),
		locks:     newVolumeLocks(),
		published: newPathBook(),
		nodeID:    opts.NodeID,
	}
	sw, err := sweeper.New(sweeper.Options{
		DriverName: Name, KubeletRoot: opts.KubeletRoot, Interval: opts.SweepInterval, Confirm: opts.SweepConfirm,
		Finder: s.finder, Mounter: s.mounter, Recorder: opts.Events, TryLock: s.locks.tryLock,
	})
	if err != nil {
		return nil, err
	}
	s.sweeper = sw
	return s, nil
}

// Run runs the stale staging sweeper until ctx ends.
func (s *NodeService) Run(ctx context.Context) {
	if s.opts.SweepInterval < 0 {
		return
	}
	s.sweeper.Run(ctx)
}

// withVolume puts the volume (and the VM, once known) on every log line of
// the call.
func (s *NodeService) withVolume(ctx context.Context, volumeID string) (context.Context, klog.Logger) {
	logger := klog.FromContext(ctx).WithValues("volume", volumeID)
	s.idMu.Lock()
	if s.nodeID != "" {
		logger = logger.WithValues("vm", s.nodeID)
	}
	s.idMu.Unlock()
	return klog.NewContext(ctx, logger), logger
}

func (s *NodeService) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_VOLUME_CONDITION,
		// Kubelet sends the new single-node modes only when the node
		// plugin offers this too; NodePublishVolume then refuses a second
		// target of a SINGLE_NODE_SINGLE_WRITER volume.
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (s *NodeService) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
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
	return &csi.NodeGetInfoResponse{NodeId: s.nodeID, MaxVolumesPerNode: s.maxVolumes(ctx)}, nil
}

// maxVolumes is how many volumes this node's VM can hold: KubeVirt's limit
// on a VM's disks less the disks the guest sees that are not hot-plugged
// volumes (root, cloud-init, CD-ROMs), capped by --max-volumes-per-node.
// The guest's view is the node plugin's only one (it does not read the
// host), and it is the VM's: each disk of the VM is a disk in the guest.
// Kubelet asks again every nodeAllocatableUpdatePeriodSeconds where the
// guest Kubernetes has MutableCSINodeAllocatableCount, so the count follows
// disks added to the VM by other means. A VM with no room left still reports
// 1: 0 would mean "no limit".
func (s *NodeService) maxVolumes(ctx context.Context) int64 {
	others, err := s.finder.OtherDisks()
	if err != nil {
		klog.FromContext(ctx).Error(err, "cannot count this VM's own disks: reporting only the configured limit", "vm", s.nodeID)
		return s.opts.MaxVolumesPerNode
	}
	room := int64(max(hotplug.MaxVMDisks-others, 1))
	if limit := s.opts.MaxVolumesPerNode; limit > 0 && limit < room {
		room = limit
	}
	return room
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
	var symlink *mounter.SymlinkError
	var damaged *mounter.FilesystemError
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	case errors.Is(err, device.ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	// A damaged filesystem, like the others, waits for a person: kubelet
	// retries, but only a repair by hand changes the answer.
	case errors.As(err, &inUse), errors.As(err, &ambiguous), errors.As(err, &mismatch), errors.As(err, &symlink),
		errors.As(err, &damaged):
		return status.Error(codes.FailedPrecondition, err.Error())
	default:
		return status.Error(codes.Internal, err.Error())
	}
}
