package driver

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// ControllerGetVolume reports one volume: the VMs it is attached to (by the
// same test a finished publish passes, as ListVolumes does; an RWX volume as
// rwxPublished says) and whether it is
// healthy (volumeCondition). A volume whose host PVC does not exist and that
// no VM holds is NotFound.
func (s *controllerService) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	if !validObjectName(id) {
		return nil, notAVolume(id)
	}
	readCtx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	pvc, err := s.volumes.GetVolume(readCtx, id)
	cancel()
	switch {
	case apierrors.IsNotFound(err):
		if len(s.hotplug.Holders(id)) == 0 {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist: no host PVC of that name", id)
		}
		pvc = nil // gone behind the driver's back while VMs still hold it
	case err != nil:
		return nil, apiStatus(err, "get host PVC %s", id)
	}
	vol := &csi.Volume{VolumeId: id}
	published := slices.Clone(s.hotplug.Published()[id])
	var storage []host.StorageIssue
	if pvc != nil {
		capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
		vol.CapacityBytes = capacity.Value()
		readCtx, cancel := context.WithTimeout(ctx, hostCallTimeout)
		fs, err := s.networkFSOf(readCtx, pvc)
		cancel()
		if err != nil {
			return nil, err
		}
		if fs != nil {
			if published, err = s.rwxPublished(ctx, id, fs); err != nil {
				return nil, err
			}
		} else {
			storage = s.hostStorage(ctx, pvc, published)
		}
	}
	return &csi.ControllerGetVolumeResponse{
		Volume: vol,
		Status: &csi.ControllerGetVolumeResponse_VolumeStatus{
			PublishedNodeIds: published,
			VolumeCondition:  s.condition(id, pvc, storage),
		},
	}, nil
}

// HostStorage reads the host storage path under a volume: its Longhorn
// volume and its VMs' attachment pods (pkg/host.StorageReader).
type HostStorage interface {
	Issues(ctx context.Context, q host.StorageQuery) ([]host.StorageIssue, error)
}

// hostStorage says what on the host keeps a hot-plugged volume from the VMs
// that hold it; the attachment pods are looked at only for the holders whose
// hotplug is not done (published: those whose is). It never fails the call:
// the condition is a report, and a read the identity may not make or that
// fails leaves only its part out (the reader logs refusals once).
func (s *controllerService) hostStorage(ctx context.Context, pvc *corev1.PersistentVolumeClaim, published []string) []host.StorageIssue {
	if s.opts.HostStorage == nil {
		return nil
	}
	holders := s.hotplug.Holders(pvc.Name)
	var waiting []string
	for _, vm := range holders {
		if !slices.Contains(published, vm) {
			waiting = append(waiting, vm)
		}
	}
	readCtx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	issues, err := s.opts.HostStorage.Issues(readCtx, host.StorageQuery{Claim: pvc, Holders: holders, Waiting: waiting})
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Host storage path partly unread for the volume condition", "volume", pvc.Name, "vms", holders, "err", err)
	}
	return issues
}

// condition says whether a volume is healthy. It is abnormal when its host
// PVC is gone (pvc nil) or going while VMs still hold it, or Lost, when a
// VM's spec has it but the VM's running VMI lost the hotplug (harvester
// 10588: the guest has no disk although every object says attached), or
// when the host storage path under it says why it does not reach its VM
// (storage: its Longhorn volume, its attachment pods).
func (s *controllerService) condition(id string, pvc *corev1.PersistentVolumeClaim, storage []host.StorageIssue) *csi.VolumeCondition {
	var problems []string
	switch {
	case pvc == nil:
		problems = append(problems, fmt.Sprintf("host PVC %s does not exist, but VM %s still holds the volume", id, strings.Join(s.hotplug.Holders(id), ", ")))
	case pvc.DeletionTimestamp != nil:
		problems = append(problems, fmt.Sprintf("host PVC %s is being deleted", id))
	case pvc.Status.Phase == corev1.ClaimLost:
		problems = append(problems, fmt.Sprintf("host PVC %s is Lost: its host volume is gone", id))
	}
	if lost := s.hotplug.Lost(id); len(lost) > 0 {
		problems = append(problems, fmt.Sprintf("VM %s has the volume in its spec but its running VMI lost the hotplug: the guest has no disk for it", strings.Join(lost, ", ")))
	}
	for _, i := range storage {
		problems = append(problems, i.Message)
	}
	if len(problems) > 0 {
		return &csi.VolumeCondition{Abnormal: true, Message: "volume " + id + ": " + strings.Join(problems, "; ")}
	}
	return &csi.VolumeCondition{Message: "volume " + id + " is healthy"}
}
