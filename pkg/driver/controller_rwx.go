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

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
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
	ListNetworkFS(ctx context.Context) ([]host.NetworkFS, error)
	CreateNetworkFS(ctx context.Context, name, desired string) (*host.NetworkFS, error)
	SetNetworkFSState(ctx context.Context, name, desired string) (*host.NetworkFS, error)
	WaitNetworkFS(ctx context.Context, name string, done func(*host.NetworkFS) bool) (*host.NetworkFS, error)
	DeleteNetworkFS(ctx context.Context, name string) error
	StorageClassProvisioner(ctx context.Context, name string) (provisioner string, known bool, err error)
}

// ClaimUsers tells whether guest pods still use the guest claim of a
// volume (pkg/guest.Claims, the guest pod cache).
type ClaimUsers interface {
	// Users names the pods ("namespace/name on node") that are not finished
	// and use the claim bound to the volume's guest PV. fresh asks the API
	// server instead of the cache, for the last look before a decision.
	Users(ctx context.Context, volume string, fresh bool) ([]string, error)
}

// GuestAttachments lists the guest's VolumeAttachments of a volume
// (pkg/guest.Claims): the record of which nodes an RWX volume is published to.
type GuestAttachments interface {
	// Attachments are this driver's VolumeAttachments of the volume's guest
	// PV. fresh asks the API server instead of the cache.
	Attachments(ctx context.Context, volume string, fresh bool) ([]guest.Attachment, error)
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
	spec := host.VolumeSpec{Name: name, Bytes: bytes, Mode: corev1.PersistentVolumeFilesystem, StorageClass: params[paramHostStorageClass],
		Annotations: map[string]string{host.AccessModeAnnotation: host.AccessModeShared}}
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
	if shared, err := s.sharedVolume(ctx, pvc); err != nil || !shared {
		if err == nil {
			err = status.Errorf(codes.AlreadyExists, "volume %s already exists as a single-node volume: host PVC %s was not created ReadWriteMany and has no NetworkFilesystem", name, name)
		}
		return nil, err
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

// sharedVolume says whether a host PVC is a ReadWriteMany volume: created
// so by this driver (the annotation), or with a NetworkFilesystem for its
// Longhorn volume, which is how a volume of the upstream driver (no
// annotation) shows it. On the host both kinds are Filesystem PVCs with the
// same access modes, so nothing else tells them apart.
func (s *controllerService) sharedVolume(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (bool, error) {
	if pvc.Annotations[host.AccessModeAnnotation] == host.AccessModeShared {
		return true, nil
	}
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	fs, err := s.networkFSOf(ctx, pvc)
	return fs != nil, err
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
	if err := s.checkVM(ctx, vol, vm); err != nil {
		return nil, err
	}
	fsName := pvc.Spec.VolumeName
	logger := klog.FromContext(ctx).WithValues("volume", vol, "vm", vm, "networkFilesystem", fsName)
	if err := s.enableRWX(ctx, vol, fsName); err != nil {
		return nil, err
	}
	waitCtx, cancel := s.publishWindow(ctx, "publish", vol, vm)
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

// checkVM answers NotFound when the node ID names no VM of the host: nothing
// is hot-plugged for an RWX volume, so no VM write would notice it, and an
// export enabled for a node that does not exist would serve nobody.
func (s *controllerService) checkVM(ctx context.Context, vol, vm string) error {
	if s.opts.VMs == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	exists, err := s.opts.VMs.VMExists(ctx, vm)
	switch {
	case err != nil:
		return apiStatus(err, "volume %s: read VM %s", vol, vm)
	case !exists:
		return status.Errorf(codes.NotFound, "volume %s: node ID %s names no VM in the host namespace", vol, vm)
	}
	return nil
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
	}
	fs, err := s.networkFSOf(ctx, pvc)
	if err != nil || fs == nil {
		return nil, nil, err
	}
	return pvc, fs, nil
}

// networkFSOf reads the NetworkFilesystem of a host PVC; nil when the PVC
// cannot have one (block, not bound) or has none.
func (s *controllerService) networkFSOf(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (*host.NetworkFS, error) {
	if s.opts.NetworkFS == nil || s.opts.RWX == nil || !s.opts.RWX() ||
		pvc.Spec.VolumeName == "" || (pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock) {
		return nil, nil
	}
	fs, err := s.opts.NetworkFS.GetNetworkFS(ctx, pvc.Spec.VolumeName)
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, apiStatus(err, "volume %s: read NetworkFilesystem %s/%s", pvc.Name, host.NetworkFSNamespace, pvc.Spec.VolumeName)
	}
	return fs, nil
}

// rwxPublished names the VMs an NFS-served volume is published to: those of
// its attached guest VolumeAttachments while its export is Enabled. A
// disabled export is published nowhere, whatever the guest says: reporting
// none makes the external-attacher's reconciler publish its attachments
// again, and the publish enables the export. Without a guest client the
// driver cannot tell, and reports none.
func (s *controllerService) rwxPublished(ctx context.Context, vol string, fs *host.NetworkFS) ([]string, error) {
	if fs.Spec.DesiredState != host.NetworkFSEnabled || s.opts.Attachments == nil {
		return nil, nil
	}
	atts, err := s.opts.Attachments.Attachments(ctx, vol, false)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "volume %s: cannot read the guest's VolumeAttachments: %v", vol, err)
	}
	var vms []string
	for _, a := range atts {
		if a.Attached && !slices.Contains(vms, a.VM) {
			vms = append(vms, a.VM)
		}
	}
	slices.Sort(vms)
	return vms, nil
}

// otherAttachments are the VolumeAttachments of a volume that keep its
// export needed by a node other than vm's: not being deleted (Kubernetes
// deletes one only once its Node no longer uses the volume, or after
// maxWaitForUnmountDuration, when a pod still there is counted as a user),
// attached or being attached.
func (s *controllerService) otherAttachments(ctx context.Context, vol, vm string, fresh bool) ([]string, error) {
	atts, err := s.opts.Attachments.Attachments(ctx, vol, fresh)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, a := range atts {
		if !a.Deleting && a.VM != vm {
			out = append(out, a.String())
		}
	}
	return out, nil
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
		// Kubelet stages a volume from its Node's VolumeAttachment, with no
		// new publish: another node's attachment needs the export even
		// when no pod there uses the claim yet.
		if s.opts.Attachments == nil {
			continue
		}
		others, err := s.otherAttachments(ctx, vol, vm, fresh)
		if err != nil {
			return true, status.Errorf(codes.Unavailable, "volume %s: cannot tell whether other nodes still have it attached, so NetworkFilesystem %s/%s stays enabled: %v", vol, host.NetworkFSNamespace, fs.Name, err)
		}
		if len(others) > 0 {
			logger.Info("ReadWriteMany volume unpublished; export left enabled for the other nodes it is attached to", "volumeAttachments", strings.Join(others, ", "))
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
	if err := s.rwxStillPublished(ctx, vol, fs); err != nil {
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

// rwxStillPublished answers FailedPrecondition while an NFS-served volume is
// published (CSI allows it for DeleteVolume): a guest VolumeAttachment of it
// exists, or its export is enabled and guest pods use its claim. Deleting
// the export would cut off nodes that mount it. Without a guest client the
// driver cannot tell, and deletes.
func (s *controllerService) rwxStillPublished(ctx context.Context, vol string, fs *host.NetworkFS) error {
	if s.opts.Attachments != nil {
		atts, err := s.opts.Attachments.Attachments(ctx, vol, true)
		if err != nil {
			return status.Errorf(codes.Unavailable, "volume %s: cannot read the guest's VolumeAttachments before deleting NetworkFilesystem %s/%s: %v", vol, host.NetworkFSNamespace, fs.Name, err)
		}
		if len(atts) > 0 {
			names := make([]string, len(atts))
			for i, a := range atts {
				names[i] = a.String()
			}
			return status.Errorf(codes.FailedPrecondition, "volume %s is still published: guest VolumeAttachments %s", vol, strings.Join(names, ", "))
		}
	}
	if s.opts.ClaimUsers != nil && fs.Spec.DesiredState == host.NetworkFSEnabled {
		users, err := s.opts.ClaimUsers.Users(ctx, vol, true)
		if err != nil {
			return status.Errorf(codes.Unavailable, "volume %s: cannot tell whether guest pods still use it before deleting NetworkFilesystem %s/%s: %v", vol, host.NetworkFSNamespace, fs.Name, err)
		}
		if len(users) > 0 {
			return status.Errorf(codes.FailedPrecondition, "volume %s is still published: its export is enabled and guest pods %s use it", vol, strings.Join(users, ", "))
		}
	}
	return nil
}
