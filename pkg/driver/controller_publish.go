package driver

import (
	"context"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
)

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
		return nil, s.failAttachment(ctx, vol, vm, err)
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
			return nil, s.failAttachment(ctx, vol, vm, err)
		}
		if err := s.hotplug.Detach(ctx, vm, vol); err != nil {
			return nil, s.failAttachment(ctx, vol, vm, err)
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
// it mounted). It returns the guard's *guest.InUseError, or a
// *guestUseUnknownError when the guard cannot tell.
func (s *controllerService) guardDetach(ctx context.Context, vm, vol string) error {
	g := s.opts.DetachGuard
	if g == nil || !slices.Contains(s.hotplug.Holders(vol), vm) {
		return nil
	}
	err := g.Allow(ctx, vm, vol)
	if err == nil || isA[*guest.InUseError](err) {
		return err
	}
	return &guestUseUnknownError{volume: vol, vm: vm, err: err}
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
