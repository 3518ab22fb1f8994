package driver

import (
	"context"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// nodeRequest is the part of a node request every call checks the same way.
type nodeRequest struct {
	volumeID string
	// paths must be given, absolute and clean: kubelet sends exactly that,
	// and anything else reaches mount(8) and the kernel as something other
	// than the path kubelet meant ("--version", "a/../../etc").
	paths []namedPath
	// capability is checked when given or when required.
	capability     *csi.VolumeCapability
	needCapability bool
}

type namedPath struct{ what, path string }

func (r nodeRequest) validate() error {
	if r.volumeID == "" {
		return status.Error(codes.InvalidArgument, "volume ID missing")
	}
	for _, p := range r.paths {
		if p.path == "" {
			return status.Errorf(codes.InvalidArgument, "%s missing", p.what)
		}
		if !cleanAbs(p.path) {
			return status.Errorf(codes.InvalidArgument, "%s %q is not an absolute path in clean form (%q)", p.what, p.path, filepath.Clean(p.path))
		}
	}
	if r.capability != nil || r.needCapability {
		return checkCapability(r.capability)
	}
	return nil
}

func cleanAbs(p string) bool { return filepath.IsAbs(p) && filepath.Clean(p) == p }

// begin validates r, puts the volume (and VM) on every log line of the call
// and takes the volume's lock; the caller defers release.
func (s *NodeService) begin(ctx context.Context, r nodeRequest) (_ context.Context, _ klog.Logger, release func(), _ error) {
	if err := r.validate(); err != nil {
		return nil, klog.Logger{}, nil, err
	}
	ctx, logger := s.withVolume(ctx, r.volumeID)
	release, err := s.locks.lock(r.volumeID)
	if err != nil {
		return nil, klog.Logger{}, nil, err
	}
	return ctx, logger, release, nil
}
