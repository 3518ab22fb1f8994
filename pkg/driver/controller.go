package driver

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
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

// Hotplug is what the controller needs from the per-VM hotplug queue
// (*hotplug.Queue). Attach and Detach return nil or one of the errors listed
// at hotplug.ErrNotReady; answerFor (controller_errors.go) holds the gRPC
// code and the Event of each.
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
	// HostStorage, when set, reads the host storage path under a volume
	// for ControllerGetVolume's condition (pkg/host.StorageReader).
	HostStorage HostStorage
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
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
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
		if src.GetVolume() != nil {
			requested := spec.Bytes
			if err := s.cloneSpec(ctx, req, &spec); err != nil {
				return nil, err
			}
			return s.createVolume(ctx, req, spec, max(requested, spec.Bytes))
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
	return s.createVolume(ctx, req, spec, spec.Bytes)
}

// createVolume creates the host PVC of spec and answers with it once bound,
// grown to want bytes when the host made it smaller (a clone).
func (s *controllerService) createVolume(ctx context.Context, req *csi.CreateVolumeRequest, spec host.VolumeSpec, want int64) (*csi.CreateVolumeResponse, error) {
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
	if pvc, err = s.growClone(ctx, pvc, want); err != nil {
		return nil, err
	}
	capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId:      pvc.Name,
		CapacityBytes: capacity.Value(),
		VolumeContext: req.GetParameters(),
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
		if inUseOnHost(err) {
			// Harvester's PVC validator still sees the claim in a VM
			// template (its cache can lag the VM that let go): CSI's
			// "volume in use", retried by the provisioner.
			return nil, status.Errorf(codes.FailedPrecondition, "delete host PVC %s: %v", req.GetVolumeId(), err)
		}
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
