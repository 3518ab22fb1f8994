package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// ReadWriteMany volumes, as upstream serves them: the host PVC is a Longhorn
// Filesystem volume, and Harvester's networkfs-manager exports it over NFS
// while its NetworkFilesystem (harvester-system, named after the Longhorn
// volume, i.e. the host PV) is Enabled. Nothing is hot-plugged: publish
// enables the export and hands the node its address, the node mounts it.

// Publish context keys of an RWX volume, read by NodeStageVolume.
const (
	nfsEndpointKey = "nfsEndpoint"
	nfsExportKey   = "nfsExport"
	nfsOptionsKey  = "nfsMountOptions"
)

// rwxBindWait bounds CreateVolume's wait for the Longhorn volume behind the
// host PVC (upstream waits 60 s); the provisioner retries after it.
const rwxBindWait = time.Minute

// NetworkFilesystems is what RWX volumes need of the host (pkg/host.Client).
type NetworkFilesystems interface {
	GetNetworkFS(ctx context.Context, name string) (*host.NetworkFS, error)
	CreateNetworkFS(ctx context.Context, name, desired string) (*host.NetworkFS, error)
	SetNetworkFSState(ctx context.Context, name, desired string) (*host.NetworkFS, error)
	WaitNetworkFS(ctx context.Context, name string, done func(*host.NetworkFS) bool) (*host.NetworkFS, error)
	DeleteNetworkFS(ctx context.Context, name string) error
	StorageClassProvisioner(ctx context.Context, name string) (provisioner string, known bool, err error)
}

// ClaimUsers tells whether guest pods still use the guest claim of a
// volume (the guest pod cache, rwxpods.go).
type ClaimUsers interface {
	// Users names the pods ("namespace/name on node") that are not finished
	// and use the claim bound to the volume's guest PV. fresh asks the API
	// server instead of the cache, for the last look before a decision.
	Users(ctx context.Context, volume string, fresh bool) ([]string, error)
}

// rwxLocks serializes the read-decide-write of one volume's export between
// publishes and unpublishes of this replica; the waits happen outside.
type rwxLocks struct {
	mu    sync.Mutex
	locks map[string]*sync.Mutex
}

func (l *rwxLocks) lock(volume string) func() {
	l.mu.Lock()
	if l.locks == nil {
		l.locks = map[string]*sync.Mutex{}
	}
	m, ok := l.locks[volume]
	if !ok {
		m = &sync.Mutex{}
		l.locks[volume] = m
	}
	l.mu.Unlock()
	m.Lock()
	return m.Unlock
}

// rwxAvailable says why RWX volumes cannot be served, or nil.
func (s *controllerService) rwxAvailable() error {
	if s.opts.NetworkFS == nil || s.opts.RWX == nil || !s.opts.RWX() {
		return status.Error(codes.InvalidArgument, "access mode MULTI_NODE_MULTI_WRITER (ReadWriteMany) is not supported here: "+
			"the host listed no NetworkFilesystems in "+host.NetworkFSNamespace+" when the driver started (Harvester's networkfs-manager is missing, or the guest may not read them)")
	}
	return nil
}

// createRWX creates a ReadWriteMany volume: the host PVC (Filesystem mode,
// on a Longhorn class), then, once Longhorn has a volume for it, its
// NetworkFilesystem, Disabled until a node publishes it. Every step finds
// what an earlier call made, so the provisioner's retries are safe.
func (s *controllerService) createRWX(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if err := s.rwxAvailable(); err != nil {
		return nil, err
	}
	name := hostPVCName(req.GetName())
	if req.GetVolumeContentSource() != nil {
		return nil, status.Errorf(codes.InvalidArgument, "volume %s: a ReadWriteMany volume cannot be created from a snapshot or another volume (as upstream)", name)
	}
	bytes, err := volumeSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	params := req.GetParameters()
	spec := host.VolumeSpec{Name: name, Bytes: bytes, Mode: corev1.PersistentVolumeFilesystem, StorageClass: params[paramHostStorageClass]}
	if spec.StorageClass == "" {
		spec.StorageClass = s.opts.HostStorageClass
	}
	readCtx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	provisioner, known, err := s.opts.NetworkFS.StorageClassProvisioner(readCtx, spec.StorageClass)
	cancel()
	switch {
	case apierrors.IsNotFound(err):
		return nil, status.Errorf(codes.InvalidArgument, "volume %s: host storage class %s does not exist", name, spec.StorageClass)
	case err != nil:
		return nil, status.Errorf(codes.Unavailable, "volume %s: check host storage class %s: %v", name, spec.StorageClass, err)
	case known && provisioner != host.LonghornProvisioner:
		return nil, status.Errorf(codes.InvalidArgument, "volume %s: host storage class %s is provisioned by %s; ReadWriteMany volumes need a Longhorn class (%s), whose share manager networkfs-manager exports",
			name, spec.StorageClass, provisioner, host.LonghornProvisioner)
	}
	pvc, err := s.volumes.CreateVolume(ctx, spec)
	var mismatch *host.VolumeMismatchError
	switch {
	case errors.As(err, &mismatch):
		return nil, status.Error(codes.AlreadyExists, err.Error())
	case err != nil:
		return nil, apiStatus(err, "create host PVC %s", name)
	}
	if pvc.Spec.VolumeName == "" {
		waitCtx, cancel := context.WithTimeout(ctx, rwxBindWait)
		if bound, err := s.volumes.WaitBound(waitCtx, name); err == nil || bound != nil {
			pvc = bound
		}
		cancel()
	}
	if pvc.Spec.VolumeName == "" {
		return nil, status.Errorf(codes.Aborted, "volume %s: host PVC %s has no Longhorn volume yet (phase %q); its NetworkFilesystem is created once it has one", name, name, pvc.Status.Phase)
	}
	fs, err := s.opts.NetworkFS.CreateNetworkFS(ctx, pvc.Spec.VolumeName, host.NetworkFSDisabled)
	var fsMismatch *host.NetworkFSMismatchError
	if errors.As(err, &fsMismatch) {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s: %v", name, err)
	}
	if err != nil {
		return nil, apiStatus(err, "volume %s: create NetworkFilesystem %s/%s", name, host.NetworkFSNamespace, pvc.Spec.VolumeName)
	}
	klog.FromContext(ctx).Info("ReadWriteMany volume created", "volume", name, "networkFilesystem", fs.Name, "desiredState", fs.Spec.DesiredState)
	capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId:      pvc.Name,
		CapacityBytes: capacity.Value(),
		VolumeContext: params,
	}}, nil
}

// publishRWX enables the volume's export and answers once networkfs-manager
// reports an endpoint: the node mounts what the publish context says. Not
// yet serving is Aborted (the attacher retries); the request stays written.
func (s *controllerService) publishRWX(ctx context.Context, vol, vm string, pvc *corev1.PersistentVolumeClaim) (*csi.ControllerPublishVolumeResponse, error) {
	if err := s.rwxAvailable(); err != nil {
		return nil, err
	}
	if pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is a block host volume (ReadWriteOnce): it cannot be published ReadWriteMany", vol)
	}
	if pvc.DeletionTimestamp != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s: host PVC %s is being deleted", vol, vol)
	}
	fsName := pvc.Spec.VolumeName
	logger := klog.FromContext(ctx).WithValues("volume", vol, "vm", vm, "networkFilesystem", fsName)
	if err := s.enableRWX(ctx, vol, fsName); err != nil {
		return nil, err
	}
	waitCtx, cancel := s.withMargin(ctx)
	defer cancel()
	fs, err := s.opts.NetworkFS.WaitNetworkFS(waitCtx, fsName, (*host.NetworkFS).Serving)
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		what := fmt.Sprintf("NetworkFilesystem %s/%s", host.NetworkFSNamespace, fsName)
		if fs != nil {
			what = fs.Describe()
		}
		return nil, status.Errorf(codes.Aborted, "volume %s: %s is not serving yet; networkfs-manager has been asked to enable it", vol, what)
	case apierrors.IsNotFound(err):
		return nil, status.Errorf(codes.Aborted, "volume %s: NetworkFilesystem %s/%s was deleted while the volume was being published", vol, host.NetworkFSNamespace, fsName)
	case err != nil:
		return nil, apiStatus(err, "volume %s: read NetworkFilesystem %s/%s", vol, host.NetworkFSNamespace, fsName)
	}
	logger.Info("ReadWriteMany volume published", "endpoint", fs.Status.Endpoint)
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{
		nfsEndpointKey: fs.Status.Endpoint,
		nfsExportKey:   "/" + fsName,
		nfsOptionsKey:  fs.Status.MountOpts,
	}}, nil
}

// enableRWX writes desiredState Enabled, creating the NetworkFilesystem when
// it is missing (a volume created before networkfs-manager was installed).
func (s *controllerService) enableRWX(ctx context.Context, vol, fsName string) error {
	defer s.rwx.lock(vol)()
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	fs, err := s.opts.NetworkFS.GetNetworkFS(ctx, fsName)
	switch {
	case apierrors.IsNotFound(err):
		if _, err := s.opts.NetworkFS.CreateNetworkFS(ctx, fsName, host.NetworkFSEnabled); err != nil {
			return apiStatus(err, "volume %s: create NetworkFilesystem %s/%s", vol, host.NetworkFSNamespace, fsName)
		}
		klog.FromContext(ctx).Info("NetworkFilesystem was missing; created it enabled", "volume", vol, "networkFilesystem", fsName)
		return nil
	case err != nil:
		return apiStatus(err, "volume %s: read NetworkFilesystem %s/%s", vol, host.NetworkFSNamespace, fsName)
	case fs.Spec.DesiredState == host.NetworkFSEnabled:
		return nil
	}
	if _, err := s.opts.NetworkFS.SetNetworkFSState(ctx, fsName, host.NetworkFSEnabled); err != nil {
		return apiStatus(err, "volume %s: enable NetworkFilesystem %s/%s", vol, host.NetworkFSNamespace, fsName)
	}
	klog.FromContext(ctx).Info("NetworkFilesystem enabled", "volume", vol, "networkFilesystem", fsName)
	return nil
}

// rwxFor returns the NetworkFilesystem of a volume that is served over NFS,
// or nil when the volume is not (a hot-plugged volume, or no host PVC any
// more: the hotplug path handles those).
func (s *controllerService) rwxFor(ctx context.Context, vol string) (*corev1.PersistentVolumeClaim, *host.NetworkFS, error) {
	if s.opts.NetworkFS == nil || s.opts.RWX == nil || !s.opts.RWX() {
		return nil, nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	pvc, err := s.volumes.GetVolume(ctx, vol)
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil, nil
	case err != nil:
		return nil, nil, apiStatus(err, "get host PVC %s", vol)
	case pvc.Spec.VolumeName == "" || (pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock):
		return nil, nil, nil
	}
	fs, err := s.opts.NetworkFS.GetNetworkFS(ctx, pvc.Spec.VolumeName)
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil, nil
	case err != nil:
		return nil, nil, apiStatus(err, "volume %s: read NetworkFilesystem %s/%s", vol, host.NetworkFSNamespace, pvc.Spec.VolumeName)
	}
	return pvc, fs, nil
}

// unpublishRWX handles ControllerUnpublishVolume of an NFS-served volume
// (handled true). The export is shared by every node: it is disabled only
// when no guest pod on any node still uses the claim; otherwise the answer
// is OK without change (the node's own mount is gone already: the
// attach/detach controller unpublishes after NodeUnstage).
func (s *controllerService) unpublishRWX(ctx context.Context, vol, vm string) (handled bool, err error) {
	if vm != "" && slices.Contains(s.hotplug.Holders(vol), vm) {
		return false, nil // hot-plugged into that VM: the queue detaches it
	}
	_, fs, err := s.rwxFor(ctx, vol)
	if err != nil || fs == nil {
		return err != nil, err
	}
	logger := klog.FromContext(ctx).WithValues("volume", vol, "vm", vm, "networkFilesystem", fs.Name)
	defer s.rwx.lock(vol)()
	if fs.Spec.DesiredState == host.NetworkFSDisabled {
		logger.V(2).Info("ReadWriteMany volume unpublished; its export is already disabled")
		return true, nil
	}
	if s.opts.ClaimUsers == nil {
		logger.Info("ReadWriteMany volume unpublished; export left enabled: without a guest client the driver cannot tell whether pods on other nodes still use it")
		return true, nil
	}
	for _, fresh := range []bool{false, true} {
		users, err := s.opts.ClaimUsers.Users(ctx, vol, fresh)
		if err != nil {
			return true, status.Errorf(codes.Unavailable, "volume %s: cannot tell whether guest pods still use it, so NetworkFilesystem %s/%s stays enabled: %v", vol, host.NetworkFSNamespace, fs.Name, err)
		}
		if len(users) > 0 {
			logger.Info("ReadWriteMany volume unpublished; export left enabled for the pods still using it", "pods", strings.Join(users, ", "))
			return true, nil
		}
	}
	wctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	if _, err := s.opts.NetworkFS.SetNetworkFSState(wctx, fs.Name, host.NetworkFSDisabled); err != nil {
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return true, apiStatus(err, "volume %s: disable NetworkFilesystem %s/%s", vol, host.NetworkFSNamespace, fs.Name)
	}
	logger.Info("ReadWriteMany volume unpublished; no guest pod uses it any more: export disabled")
	return true, nil
}

// deleteRWX removes the NetworkFilesystem of a volume before its host PVC,
// as upstream; a volume without one is left to the caller.
func (s *controllerService) deleteRWX(ctx context.Context, vol string) error {
	_, fs, err := s.rwxFor(ctx, vol)
	if err != nil || fs == nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	if err := s.opts.NetworkFS.DeleteNetworkFS(ctx, fs.Name); err != nil {
		return apiStatus(err, "volume %s: delete NetworkFilesystem %s/%s", vol, host.NetworkFSNamespace, fs.Name)
	}
	klog.FromContext(ctx).Info("NetworkFilesystem deleted", "volume", vol, "networkFilesystem", fs.Name)
	return nil
}
