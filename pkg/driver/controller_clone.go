package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// cloneSpec makes spec a clone of the request's source volume: a host PVC
// whose data source is the source's host PVC, with its class and volume mode
// (as a restore takes the snapshot's) and its size. Longhorn clones only at
// the source's size (longhorn-manager v1.10.1 csi/controller_server.go:201,
// OutOfRange "the requested size ... is different than the source volume
// size"), so a larger request is met by growing the clone once it is bound
// (growClone).
func (s *controllerService) cloneSpec(ctx context.Context, req *csi.CreateVolumeRequest, spec *host.VolumeSpec) error {
	id := req.GetVolumeContentSource().GetVolume().GetVolumeId()
	if id == "" {
		return status.Error(codes.InvalidArgument, "volume content source has no volume ID")
	}
	if !validObjectName(id) {
		return notAVolume(id)
	}
	src, err := s.getVolume(ctx, id)
	if err != nil {
		return err
	}
	if src.DeletionTimestamp != nil {
		return status.Errorf(codes.NotFound, "source volume %s of clone %s is being deleted", id, spec.Name)
	}
	size := src.Spec.Resources.Requests[corev1.ResourceStorage]
	if limit := req.GetCapacityRange().GetLimitBytes(); limit > 0 && size.Value() > limit {
		return status.Errorf(codes.OutOfRange, "source volume %s holds %d bytes, more than the limit of %d bytes", id, size.Value(), limit)
	}
	spec.FromVolume = id
	spec.Bytes = size.Value()
	// A source without a class has the host's default, as its clone then.
	spec.StorageClass = ""
	if src.Spec.StorageClassName != nil {
		spec.StorageClass = *src.Spec.StorageClassName
	}
	spec.Mode = corev1.PersistentVolumeFilesystem
	if src.Spec.VolumeMode != nil {
		spec.Mode = *src.Spec.VolumeMode
	}
	klog.FromContext(ctx).V(2).Info("volume to be cloned", "volume", spec.Name, "source", id, "bytes", spec.Bytes, "class", spec.StorageClass, "mode", spec.Mode)
	return nil
}

// growClone raises a clone's host request to want bytes once it is bound:
// Kubernetes resizes only bound claims, so an unbound clone that must grow
// is Unavailable and the provisioner's retry finds it again.
func (s *controllerService) growClone(ctx context.Context, pvc *corev1.PersistentVolumeClaim, want int64) (*corev1.PersistentVolumeClaim, error) {
	if have := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; have.Value() >= want {
		return pvc, nil
	}
	if pvc.Status.Phase != corev1.ClaimBound {
		return nil, status.Errorf(codes.Unavailable, "volume %s: the clone is not bound on the host yet; it grows to %d bytes once it is", pvc.Name, want)
	}
	ectx, cancel := context.WithTimeout(ctx, bindWait)
	defer cancel()
	grown, err := s.volumes.ExpandVolume(ectx, pvc.Name, want)
	if err != nil {
		// The request stays raised: the retry waits for the capacity.
		return nil, apiStatus(err, "volume %s: grow the cloned host PVC to %d bytes", pvc.Name, want)
	}
	return grown, nil
}
