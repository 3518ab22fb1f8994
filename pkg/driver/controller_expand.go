package driver

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
)

// expandWait bounds how long one ControllerExpandVolume waits for the host to
// report the new size (Longhorn grows a volume in seconds, attached or not);
// the resizer retries after a DeadlineExceeded.
const expandWait = time.Minute

// ControllerExpandVolume grows the host PVC. The guest's filesystem (or the
// block device's size as the guest sees it) follows in NodeExpandVolume,
// so node expansion is always asked for.
func (s *controllerService) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	if req.GetCapacityRange() == nil {
		return nil, status.Error(codes.InvalidArgument, "capacity range is required")
	}
	if !validObjectName(id) {
		return nil, notAVolume(id)
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapabilities([]*csi.VolumeCapability{c}); err != nil {
			return nil, err
		}
		if multiNode(c) {
			return nil, status.Errorf(codes.InvalidArgument, "volume %s: expanding a ReadWriteMany (NFS) volume is not supported, as upstream", id)
		}
	}
	bytes, err := volumeSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	waitCtx, cancel := context.WithTimeout(ctx, expandWait)
	defer cancel()
	pvc, err := s.volumes.ExpandVolume(waitCtx, id, bytes)
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		return nil, status.Errorf(codes.DeadlineExceeded, "host PVC %s has not grown to %d bytes yet", id, bytes)
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "resize"):
		// The host StorageClass does not allow expansion: retrying cannot help.
		return nil, status.Errorf(codes.FailedPrecondition, "host PVC %s cannot be expanded: %v", id, err)
	case err != nil:
		return nil, apiStatus(err, "expand host PVC %s", id)
	}
	capacity := pvc.Status.Capacity[corev1.ResourceStorage]
	klog.FromContext(ctx).Info("volume expanded on the host", "volume", id, "bytes", capacity.Value())
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: capacity.Value(), NodeExpansionRequired: true}, nil
}
