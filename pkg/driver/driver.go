// Package driver is the CSI gRPC surface of the Harvester CSI driver: it
// validates requests, delegates to the hotplug queue, the host cluster and the
// node-side code, and maps their errors to gRPC codes.
package driver

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// Name is the CSI driver name, identical to upstream so existing PVs,
// VolumeAttachments and CSINode entries keep working.
const Name = "driver.harvesterhci.io"

// gracePeriod bounds how long a stopping server waits for calls in flight.
const gracePeriod = 5 * time.Second

// Driver serves the CSI services enabled by its options.
type Driver struct {
	identity   csi.IdentityServer
	controller csi.ControllerServer // nil when node-only
	node       csi.NodeServer       // nil when controller-only
	// ready says why the controller cannot answer yet (nil: it can).
	ready func() error
}

// New assembles a driver from the parts it should serve; a nil controller or
// node service leaves that service unregistered. Until the controller is
// ready, Probe says not ready and controller calls answer Unavailable.
func New(version string, controller *Controller, node csi.NodeServer) *Driver {
	d := &Driver{node: node, ready: func() error { return nil }}
	if controller != nil {
		d.controller, d.ready = controller.Service(), controller.Ready
	}
	d.identity = &identityService{version: version, controller: controller != nil, ready: d.ready}
	return d
}

// Serve listens on endpoint (unix:///path or tcp://host:port) until ctx ends.
func (d *Driver) Serve(ctx context.Context, endpoint string) error {
	l, err := Listen(endpoint)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(logCalls, recoverPanics, d.gateController))
	d.Register(srv)
	go func() {
		<-ctx.Done()
		// Let short calls finish, but do not wait out callers blocked on a
		// hotplug that can no longer complete in this process.
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(gracePeriod):
			srv.Stop()
		}
	}()
	klog.FromContext(ctx).Info("serving CSI", "endpoint", endpoint, "controller", d.controller != nil, "node", d.node != nil)
	return srv.Serve(l)
}

// Register adds the enabled services to srv.
func (d *Driver) Register(srv *grpc.Server) {
	csi.RegisterIdentityServer(srv, d.identity)
	if d.controller != nil {
		csi.RegisterControllerServer(srv, d.controller)
	}
	if d.node != nil {
		csi.RegisterNodeServer(srv, d.node)
	}
}

// Listen opens a CSI endpoint, replacing a stale unix socket left by a
// previous run.
func Listen(endpoint string) (net.Listener, error) {
	u, err := url.Parse(endpoint)
	if err != nil {
		return nil, fmt.Errorf("invalid endpoint %q: %w", endpoint, err)
	}
	switch u.Scheme {
	case "unix":
		path := u.Path
		if path == "" {
			path = u.Host
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return nil, err
		}
		if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
			return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
		return net.Listen("unix", path)
	case "tcp":
		return net.Listen("tcp", u.Host)
	default:
		return nil, fmt.Errorf("invalid endpoint %q: scheme must be unix or tcp", endpoint)
	}
}

// gateController answers controller calls Unavailable until the controller
// is ready: an unsynced cache would say "not attached" about every volume,
// and a detach answered from it would strand the volume on its VM. Only the
// static capabilities are served before.
func (d *Driver) gateController(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if strings.HasPrefix(info.FullMethod, "/csi.v1.Controller/") && info.FullMethod != "/csi.v1.Controller/ControllerGetCapabilities" {
		if err := d.ready(); err != nil {
			return nil, status.Error(codes.Unavailable, err.Error())
		}
	}
	return handler(ctx, req)
}

// recoverPanics turns a panic in a handler into an Internal answer with the
// stack in the log, so one bad request cannot take down every volume
// operation of the node or cluster.
func recoverPanics(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if r := recover(); r != nil {
			klog.FromContext(ctx).Error(fmt.Errorf("panic: %v", r), "handler panicked", "method", info.FullMethod, "stack", string(debug.Stack()))
			resp, err = nil, status.Errorf(codes.Internal, "internal error in %s: %v", info.FullMethod, r)
		}
	}()
	return handler(ctx, req)
}

func logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	logger := klog.FromContext(ctx).WithValues("method", info.FullMethod)
	if v, ok := req.(interface{ GetVolumeId() string }); ok && v.GetVolumeId() != "" {
		logger = logger.WithValues("volume", v.GetVolumeId())
	}
	if v, ok := req.(interface{ GetNodeId() string }); ok && v.GetNodeId() != "" {
		logger = logger.WithValues("vm", v.GetNodeId())
	}
	ctx = klog.NewContext(ctx, logger)
	logger.V(4).Info("call")
	resp, err := handler(ctx, req)
	switch code := status.Code(err); {
	case err == nil:
		logger.V(4).Info("call done")
	case code == codes.Aborted || code == codes.DeadlineExceeded:
		// What the caller retries by design: a detach the guest still
		// holds, a change KubeVirt is still making, a newer request.
		logger.V(2).Info("call not done yet; the caller retries", "code", code, "reason", err.Error())
	case code == codes.Unavailable:
		// Not ready yet, a disk still arriving, or the host not answering:
		// retried too, but an operator wants to see it at the default level.
		logger.Info("call answered Unavailable; the caller retries", "reason", err.Error())
	default:
		logger.Error(err, "call failed", "code", code)
	}
	return resp, err
}
