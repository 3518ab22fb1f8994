package driver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// StorageClass parameters understood by CreateVolume (upstream names).
const (
	paramHostStorageClass = "hostStorageClass"
	paramHostVolumeMode   = "hostVolumeMode"
)

const (
	defaultMargin = 2 * time.Second
	bindWait      = 10 * time.Second
	// hostCallTimeout bounds one read of the host API in a CSI call, so a
	// host that hangs is reported as unavailable instead of as a deadline.
	hostCallTimeout = 15 * time.Second
)

// Hotplug is what the controller needs from the per-VM hotplug queue.
type Hotplug interface {
	Attach(ctx context.Context, vm, volume string, exclusive bool) error
	Detach(ctx context.Context, vm, volume string) error
	Holders(volume string) []string
	Published() map[string][]string
	// Lost lists the VMs whose spec holds the volume while their running
	// VMI dropped it.
	Lost(volume string) []string
}

// DetachGuard decides whether a volume may leave a VM now, from what the
// guest cluster says about its use (pkg/guest.Guard).
type DetachGuard interface {
	// Allow returns nil to go ahead, or why not (*guest.InUseError,
	// guest.ErrNotSynced).
	Allow(ctx context.Context, vm, volume string) error
	// Done ends an unplug's count: it finished, or the volume was
	// published to the VM again.
	Done(vm, volume string)
}

// HostVolumes is what the controller needs from the host cluster's PVCs.
type HostVolumes interface {
	CreateVolume(ctx context.Context, spec host.VolumeSpec) (*corev1.PersistentVolumeClaim, error)
	GetVolume(ctx context.Context, name string) (*corev1.PersistentVolumeClaim, error)
	DeleteVolume(ctx context.Context, name string) error
	WaitBound(ctx context.Context, name string) (*corev1.PersistentVolumeClaim, error)
	StorageClassUsable(ctx context.Context, name string) (bool, error)
	ListVolumes(ctx context.Context) ([]corev1.PersistentVolumeClaim, error)
	ExpandVolume(ctx context.Context, name string, bytes int64) (*corev1.PersistentVolumeClaim, error)
	CreateSnapshot(ctx context.Context, name, volume string) (*host.Snapshot, error)
	GetSnapshot(ctx context.Context, name string) (*host.Snapshot, error)
	DeleteSnapshot(ctx context.Context, name string) error
	ListSnapshots(ctx context.Context) ([]host.Snapshot, error)
}

// ControllerOptions configure the controller service.
type ControllerOptions struct {
	// HostStorageClass is --host-storage-class: the host class used when the
	// guest StorageClass does not name one.
	HostStorageClass string
	// PublishMargin is kept free before the caller's deadline so a publish or
	// unpublish that is still in flight answers DeadlineExceeded in time.
	PublishMargin time.Duration
	// PublishWait, when set, bounds how long a publish or unpublish waits
	// for KubeVirt before it answers "still in progress" (the intent stays
	// queued, and the caller's retry finds it done) while PublishWaitCrowd
	// calls wait at once (1 or less: always). Zero: up to the caller's
	// deadline. A short wait frees the attacher's worker for the next
	// volume, so every change of a wave reaches the queue at once; a call
	// that waits alone holds a worker nobody needs and is answered as soon
	// as KubeVirt is done, without the attacher's retry backoff.
	PublishWait      time.Duration
	PublishWaitCrowd int
	// DetachGuard, when set, is asked before a volume is unplugged from a
	// VM on ControllerUnpublishVolume (never for the queue's own cleanup).
	DetachGuard DetachGuard
	// Events, when set, is told why a publish or unpublish is not done yet,
	// for the guest's VolumeAttachment.
	Events AttachmentEvents
	// NetworkFS reaches Harvester's NetworkFilesystems, and RWX says whether
	// the host listed them at start-up: ReadWriteMany volumes need both.
	NetworkFS NetworkFilesystems
	RWX       func() bool
	// ClaimUsers, when set, tells whether guest pods still use a volume; an
	// RWX unpublish disables the export only when none does (nil: never).
	ClaimUsers ClaimUsers
	// Attachments, when set, lists the guest's VolumeAttachments of a
	// volume: the nodes an RWX volume is published to (nil: unknown).
	Attachments GuestAttachments
	// VMs, when set, says whether a node ID names a VM of the host.
	VMs VMs
	// Claims, when set, lets a first publish skip reading a host claim that
	// a cache already shows Bound (pkg/host.ClaimCache).
	Claims ClaimCache
}

// VMs says whether the host has a VM (the queue's cache, else a read).
type VMs interface {
	VMExists(ctx context.Context, vm string) (bool, error)
}

// ClaimCache says whether a cache of the host's PVCs shows a claim Bound;
// false means "read the API server" (unknown, not bound or gone).
type ClaimCache interface {
	ShowsBound(name string) bool
}

// AttachmentEvents records an Event on the guest VolumeAttachment of a
// volume and VM (pkg/guest.AttachmentEvents).
type AttachmentEvents interface {
	Record(ctx context.Context, volume, vm, eventType, reason, message string)
}

type controllerService struct {
	csi.UnimplementedControllerServer
	opts    ControllerOptions
	hotplug Hotplug
	volumes HostVolumes
	rwx     rwxLocks
	waiting *waiting
	// snapNames serializes CreateSnapshot calls of one name.
	snapNames nameLocks
}

// NewControllerService returns the CSI controller service.
func NewControllerService(opts ControllerOptions, hp Hotplug, volumes HostVolumes) csi.ControllerServer {
	if opts.PublishMargin <= 0 {
		opts.PublishMargin = defaultMargin
	}
	return &controllerService{opts: opts, hotplug: hp, volumes: volumes, waiting: newWaiting()}
}

func (s *controllerService) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, c := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_VOLUME,
		csi.ControllerServiceCapability_RPC_VOLUME_CONDITION,
		// With it the sidecars send ReadWriteOncePod as
		// SINGLE_NODE_SINGLE_WRITER and ReadWriteOnce as
		// SINGLE_NODE_MULTI_WRITER instead of SINGLE_NODE_WRITER for both
		// (CSI spec v1.5.0); checkCapability accepts all three.
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: c},
		}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (s *controllerService) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume name is required")
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	if anyMultiNode(req.GetVolumeCapabilities()) {
		return s.createRWX(ctx, req)
	}
	bytes, err := volumeSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	params := req.GetParameters()
	spec := host.VolumeSpec{Name: hostPVCName(req.GetName()), Bytes: bytes, Mode: corev1.PersistentVolumeBlock}
	// The guest formats the disk itself, so a single-node volume is a raw
	// block device on the host unless the class asks for a filesystem.
	if params[paramHostVolumeMode] == "filesystem" {
		spec.Mode = corev1.PersistentVolumeFilesystem
	}
	spec.StorageClass = params[paramHostStorageClass]
	if spec.StorageClass == "" {
		spec.StorageClass = s.opts.HostStorageClass
	}
	if src := req.GetVolumeContentSource(); src != nil {
		if isBackupID(src.GetSnapshot().GetSnapshotId()) {
			return s.createFromBackup(ctx, req, spec)
		}
		snap, err := s.restoreSource(ctx, src)
		if err != nil {
			return nil, err
		}
		// A restore is a copy of the source's host volume: same class and
		// mode, and at least its size.
		spec.FromSnapshot = snap.Name
		if snap.StorageClass != "" {
			spec.StorageClass = snap.StorageClass
		}
		if snap.VolumeMode != "" {
			spec.Mode = snap.VolumeMode
		}
		if snap.RestoreBytes > spec.Bytes {
			if spec.Bytes, err = volumeSize(&csi.CapacityRange{RequiredBytes: snap.RestoreBytes, LimitBytes: req.GetCapacityRange().GetLimitBytes()}); err != nil {
				return nil, err
			}
		}
	}
	if spec.StorageClass != "" {
		ok, err := s.volumes.StorageClassUsable(ctx, spec.StorageClass)
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "check host storage class %s: %v", spec.StorageClass, err)
		}
		if !ok {
			return nil, status.Errorf(codes.InvalidArgument, "host storage class %s does not exist", spec.StorageClass)
		}
	}
	pvc, err := s.volumes.CreateVolume(ctx, spec)
	var mismatch *host.VolumeMismatchError
	switch {
	case errors.As(err, &mismatch):
		return nil, status.Error(codes.AlreadyExists, err.Error())
	case err != nil:
		return nil, apiStatus(err, "create host PVC %s", spec.Name)
	}
	if spec.Mode == corev1.PersistentVolumeFilesystem {
		if shared, err := s.sharedVolume(ctx, pvc); err != nil || shared {
			if err == nil {
				err = status.Errorf(codes.AlreadyExists, "volume %s already exists as a ReadWriteMany volume (host PVC %s, served over NFS), not a single-node one", spec.Name, spec.Name)
			}
			return nil, err
		}
	}
	// Give the host a moment to bind, so a publish right after creation
	// does not start with an Aborted round trip; an unbound PVC is still a
	// created volume.
	waitCtx, cancel := context.WithTimeout(ctx, bindWait)
	if bound, err := s.volumes.WaitBound(waitCtx, pvc.Name); err == nil {
		pvc = bound
	}
	cancel()
	capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId:      pvc.Name,
		CapacityBytes: capacity.Value(),
		VolumeContext: params,
		ContentSource: req.GetVolumeContentSource(),
	}}, nil
}

func (s *controllerService) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	if !validObjectName(req.GetVolumeId()) {
		return &csi.DeleteVolumeResponse{}, nil // no host object can have that name: nothing to delete
	}
	if holders := s.hotplug.Holders(req.GetVolumeId()); len(holders) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still attached to VM %s", req.GetVolumeId(), holders[0])
	}
	if err := s.deleteRestore(ctx, req.GetVolumeId()); err != nil {
		return nil, err
	}
	if err := s.deleteRWX(ctx, req.GetVolumeId()); err != nil {
		return nil, err
	}
	if err := s.volumes.DeleteVolume(ctx, req.GetVolumeId()); err != nil {
		return nil, apiStatus(err, "delete host PVC %s", req.GetVolumeId())
	}
	return &csi.DeleteVolumeResponse{}, nil
}

func (s *controllerService) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	if !validObjectName(req.GetVolumeId()) {
		return nil, notAVolume(req.GetVolumeId())
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	if anyMultiNode(req.GetVolumeCapabilities()) {
		if err := s.rwxAvailable(); err != nil {
			return nil, err
		}
	}
	pvc, err := s.getVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if anyMultiNode(req.GetVolumeCapabilities()) && pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: fmt.Sprintf("volume %s is a block host volume (ReadWriteOnce): it cannot be shared ReadWriteMany", req.GetVolumeId())}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

func (s *controllerService) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	vol, vm := req.GetVolumeId(), req.GetNodeId()
	switch {
	case vol == "":
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	case vm == "":
		return nil, status.Error(codes.InvalidArgument, "node ID is required")
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume capability is required")
	case !validObjectName(vol):
		return nil, notAVolume(vol)
	case !validObjectName(vm):
		return nil, status.Errorf(codes.NotFound, "node ID %q cannot name a VM of the host", vm)
	}
	if err := checkCapabilities([]*csi.VolumeCapability{req.GetVolumeCapability()}); err != nil {
		return nil, err
	}
	if req.GetReadonly() {
		// This driver hot-plugs read-write disks only (no PUBLISH_READONLY;
		// the node mounts read-only when the pod asks). A volume already
		// published read-write is incompatible with a read-only publish.
		if slices.Contains(s.hotplug.Published()[vol], vm) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is already published to VM %s read-write, not read-only", vol, vm)
		}
		return nil, status.Errorf(codes.InvalidArgument, "volume %s: read-only controller publish is not supported (the capability PUBLISH_READONLY is not offered); publish read-write and mount read-only on the node", vol)
	}
	if multiNode(req.GetVolumeCapability()) {
		pvc, err := s.boundVolume(ctx, vol)
		if err != nil {
			return nil, err
		}
		return s.publishRWX(ctx, vol, vm, pvc)
	}
	// A first publish checks the claim so that a missing or unbound one is
	// answered at once, not when the VM's queued changes let the queue get
	// to it. A claim the host cache shows Bound needs no read, and a retry
	// for a volume already written to this VM skips the check: the queue
	// reads the claim from the API server right before any write of it
	// (that read is the fence, not this one).
	if !slices.Contains(s.hotplug.Holders(vol), vm) && (s.opts.Claims == nil || !s.opts.Claims.ShowsBound(vol)) {
		if _, err := s.boundVolume(ctx, vol); err != nil {
			return nil, err
		}
	}
	ctx, cancel := s.publishWindow(ctx, "publish", vol, vm)
	defer cancel()
	if err := s.hotplug.Attach(ctx, vm, vol, true); err != nil {
		s.tellAttachment(ctx, vol, vm, err)
		return nil, hotplugStatus(err)
	}
	if g := s.opts.DetachGuard; g != nil {
		g.Done(vm, vol) // a new attachment: an older refused unplug is over
	}
	klog.FromContext(ctx).Info("volume attached", "volume", vol, "vm", vm)
	return &csi.ControllerPublishVolumeResponse{}, nil
}

// boundVolume reads a host PVC and answers Aborted while it is not bound.
func (s *controllerService) boundVolume(ctx context.Context, vol string) (*corev1.PersistentVolumeClaim, error) {
	pvc, err := s.getVolume(ctx, vol)
	if err != nil {
		return nil, err
	}
	if pvc.Status.Phase != corev1.ClaimBound {
		return nil, status.Errorf(codes.Aborted, "host PVC %s is %s, not Bound yet", vol, pvc.Status.Phase)
	}
	return pvc, nil
}

func (s *controllerService) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	vol := req.GetVolumeId()
	if vol == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	if !validObjectName(vol) || (req.GetNodeId() != "" && !validObjectName(req.GetNodeId())) {
		// No host object can have that name, so nothing of it is attached.
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if handled, err := s.unpublishRWX(ctx, vol, req.GetNodeId()); handled {
		if err != nil {
			return nil, err
		}
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	vms := []string{req.GetNodeId()}
	if req.GetNodeId() == "" {
		// CSI: no node means "from every node".
		vms = s.hotplug.Holders(vol)
	}
	ctx, cancel := s.publishWindow(ctx, "unpublish", vol, req.GetNodeId())
	defer cancel()
	for _, vm := range vms {
		if err := s.guardDetach(ctx, vm, vol); err != nil {
			s.tellAttachment(ctx, vol, vm, err)
			return nil, err
		}
		if err := s.hotplug.Detach(ctx, vm, vol); err != nil {
			s.tellAttachment(ctx, vol, vm, err)
			return nil, hotplugStatus(err)
		}
		if g := s.opts.DetachGuard; g != nil {
			g.Done(vm, vol)
		}
		klog.FromContext(ctx).Info("volume detached", "volume", vol, "vm", vm)
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// guardDetach asks the detach guard before a volume the VM holds is
// unplugged (the attach/detach controller may ask while the guest still has
// it mounted). Aborted, not Unavailable: the external-attacher
// retries both with backoff, and Aborted is CSI's "an operation on this
// volume is still pending" (the guest's unmount), where Unavailable would
// say the driver itself is down.
func (s *controllerService) guardDetach(ctx context.Context, vm, vol string) error {
	g := s.opts.DetachGuard
	if g == nil || !slices.Contains(s.hotplug.Holders(vol), vm) {
		return nil
	}
	err := g.Allow(ctx, vm, vol)
	var inUse *guest.InUseError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &inUse):
		return status.Error(codes.Aborted, err.Error())
	default:
		return status.Errorf(codes.Unavailable, "volume %s on VM %s: cannot tell whether the guest still uses it: %v", vol, vm, err)
	}
}

// getVolume reads a host PVC within hostCallTimeout and answers in CSI terms.
func (s *controllerService) getVolume(ctx context.Context, id string) (*corev1.PersistentVolumeClaim, error) {
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	pvc, err := s.volumes.GetVolume(ctx, id)
	if err != nil {
		return nil, apiStatus(err, "get host PVC %s", id)
	}
	return pvc, nil
}

func notAVolume(id string) error {
	return status.Errorf(codes.NotFound, "volume %q does not exist: not a valid host PVC name", id)
}

// tellAttachment records on the guest VolumeAttachment why a publish or
// unpublish is not done: the attacher shows only the last error, and an
// operator looking at a pod stuck in ContainerCreating should see what the
// volume waits for, which VM holds it, or what the host refused.
func (s *controllerService) tellAttachment(ctx context.Context, vol, vm string, err error) {
	if s.opts.Events == nil || errors.Is(err, context.Canceled) {
		return
	}
	var held *hotplug.HeldError
	var rejected *hotplug.RejectedError
	var stalled *hotplug.StalledError
	var claim *hotplug.ClaimNotReadyError
	var inUse *guest.InUseError
	eventType, reason := corev1.EventTypeWarning, "HotplugFailed"
	msg := ""
	if st, ok := status.FromError(err); ok {
		msg = st.Message() // already a CSI answer (the detach guard's)
		if st.Code() == codes.Aborted {
			eventType, reason = corev1.EventTypeNormal, "VolumeStillInUse"
		}
	} else {
		msg = status.Convert(hotplugStatus(err)).Message()
	}
	switch {
	case errors.As(err, &held):
		reason = "VolumeHeldByAnotherVM"
	case errors.As(err, &rejected):
		reason = "HotplugRejected"
	case errors.As(err, &stalled):
		reason = "HostRefusedOrUnreachable"
	case errors.As(err, &claim):
		reason = "HostClaimNotReady"
	case errors.As(err, &inUse):
		eventType, reason = corev1.EventTypeNormal, "VolumeStillInUse"
	case errors.Is(err, context.DeadlineExceeded):
		eventType, reason = corev1.EventTypeNormal, "HotplugWaiting"
	case errors.As(err, new(*hotplug.SupersededError)):
		return // a newer request replaced this one: nothing to explain
	}
	// Use a fresh context: the call's own may be over, and the Event
	// explains its answer.
	ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), hostCallTimeout)
	defer cancel()
	s.opts.Events.Record(ectx, vol, vm, eventType, reason, msg)
}

// withMargin ends ctx a little before the caller's deadline, so a call still
// in flight answers DeadlineExceeded itself instead of being cut off.
func (s *controllerService) withMargin(ctx context.Context) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	margin := s.opts.PublishMargin
	if left := time.Until(deadline); margin > left/2 {
		margin = left / 2
	}
	return context.WithDeadline(ctx, deadline.Add(-margin))
}

func apiStatus(err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...) + ": " + err.Error()
	switch {
	case apierrors.IsNotFound(err):
		return status.Error(codes.NotFound, msg)
	case apierrors.IsAlreadyExists(err):
		return status.Error(codes.AlreadyExists, msg)
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		return status.Error(codes.PermissionDenied, msg)
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err):
		return status.Error(codes.InvalidArgument, msg)
	case apierrors.IsTimeout(err), apierrors.IsServerTimeout(err), apierrors.IsTooManyRequests(err), apierrors.IsServiceUnavailable(err),
		apierrors.IsInternalError(err), errors.Is(err, context.DeadlineExceeded), isConnectionError(err):
		// The host did not answer, or not usefully: retrying may help.
		return status.Error(codes.Unavailable, msg)
	}
	return status.Error(codes.Internal, msg)
}

// isConnectionError reports a host API that could not be reached at all.
func isConnectionError(err error) bool {
	var netErr net.Error
	var opErr *net.OpError
	return errors.As(err, &netErr) || errors.As(err, &opErr)
}

// hotplugStatus maps the queue's answers to CSI codes. Only NotFound,
// FailedPrecondition and a host rejection are final; everything in flight is
// reported with a code the external-attacher treats as "may still happen".
func hotplugStatus(err error) error {
	var held *hotplug.HeldError
	var superseded *hotplug.SupersededError
	var rejected *hotplug.RejectedError
	var stalled *hotplug.StalledError
	var claim *hotplug.ClaimNotReadyError
	switch {
	case errors.As(err, &claim) && claim.Phase == "":
		return status.Error(codes.NotFound, err.Error())
	case errors.As(err, &claim):
		return status.Error(codes.Aborted, err.Error())
	case errors.As(err, &stalled):
		// Still pending, but the host refused or did not answer: say why,
		// with the code of the cause.
		if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
			return status.Error(codes.PermissionDenied, err.Error())
		}
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, hotplug.ErrNotReady):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, hotplug.ErrVMNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.As(err, &held):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.As(err, &superseded):
		return status.Error(codes.Aborted, err.Error())
	case errors.As(err, &rejected):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, hotplug.ErrStopped):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}
