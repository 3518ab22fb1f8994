package simlonghorn

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
)

// AttachmentID is the ticket ID ControllerPublish uses: the name the
// Kubernetes attacher gives the VolumeAttachment (longhorn-manager v1.10.1
// csi/controller_server.go:552-557).
func AttachmentID(volume, node string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(volume+DriverName+node)))
}

// Serve serves the identity and controller services and, when node is set,
// the node service of that host node, on a unix socket until ctx ends.
func (s *Sim) Serve(ctx context.Context, socket, node string) error {
	_ = os.Remove(socket)
	lis, err := (&net.ListenConfig{}).Listen(ctx, "unix", socket)
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, identity{})
	csi.RegisterControllerServer(srv, &controller{s: s})
	if node != "" {
		csi.RegisterNodeServer(srv, &nodeServer{s: s, node: node})
	}
	go func() {
		<-ctx.Done()
		srv.Stop()
	}()
	if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

type identity struct {
	csi.UnimplementedIdentityServer
}

func (identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: DriverName, VendorVersion: "simlonghorn"}, nil
}

func (identity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}},
	}}}, nil
}

func (identity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

type controller struct {
	csi.UnimplementedControllerServer
	s *Sim
}

func (c *controller) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: []*csi.ControllerServiceCapability{{
		Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME}},
	}}}, nil
}

// getVolume maps a missing volume to NotFound and other failures to
// Internal, as Longhorn's CSI plugin does.
func (s *Sim) getVolume(ctx context.Context, id string) (*Volume, error) {
	v, err := s.store.getVolume(ctx, id)
	if apierrors.IsNotFound(err) {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return v, nil
}

// ready is the API's Volume.Ready for the states modeled: not faulted
// (longhorn-manager v1.10.1 api/model.go:1594-1602).
func ready(v *Volume) bool { return v.Status.Robustness != VolumeRobustnessFaulted }

// ControllerPublishVolume follows longhorn-manager v1.10.1
// csi/controller_server.go:470-581: add a csi-attacher ticket, then poll
// every 2 s for up to 90 s (both scaled) until it is satisfied and the
// engine runs on the node.
func (c *controller) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume id missing in request")
	case node == "":
		return nil, status.Error(codes.InvalidArgument, "node id missing in request")
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume capability missing in request")
	}
	log := klog.FromContext(ctx).WithValues("volume", id, "node", node)
	if _, err := c.s.kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		return nil, status.Errorf(codes.NotFound, "node %s not found", node)
	} else if err != nil {
		return nil, status.Errorf(codes.Internal, "get node %s: %v", node, err)
	}
	v, err := c.s.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	if multiNode(req.GetVolumeCapability()) && !isMigratable(v) {
		// Longhorn turns the volume into a share-manager (NFS) RWX volume
		// here; the stand-in does not model share managers.
		return nil, status.Errorf(codes.Unimplemented, "volume %s: multi-node access needs a share manager, which the Longhorn stand-in does not model", id)
	}
	if !ready(v) {
		return nil, status.Errorf(codes.Aborted, "volume %s is not ready for workloads", id)
	}
	ticket := AttachmentID(id, node)
	if err := c.s.setTicket(ctx, id, ticket, node, true); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	log.V(2).Info("Longhorn attachment ticket added", "ticket", ticket)
	published := func(v *Volume, va *VolumeAttachment) bool {
		return va.satisfied(ticket) && availableOn(v, node)
	}
	if err := c.s.waitFor(ctx, id, published); err != nil {
		if status.Code(err) != codes.DeadlineExceeded || ctx.Err() != nil {
			return nil, err
		}
		if va, gerr := c.s.store.getVA(ctx, id); gerr == nil {
			if st := va.Status.AttachmentTicketStatuses[ticket]; st != nil {
				for _, cond := range st.Conditions {
					if cond.Type == conditionSatisfied && cond.Status == "False" && cond.Message != "" {
						return nil, status.Errorf(codes.Internal, "volume %v failed to attach to node %v with attachmentID %v: %v", id, node, ticket, cond.Message)
					}
				}
			}
		}
		return nil, status.Errorf(codes.DeadlineExceeded, "volume %v failed to attach to node %v with attachmentID %v", id, node, ticket)
	}
	log.V(2).Info("Longhorn volume published")
	return &csi.ControllerPublishVolumeResponse{}, nil
}

// ControllerUnpublishVolume removes the ticket and returns once it is gone
// from the VolumeAttachment: like Longhorn (csi/controller_server.go:605-666)
// it does not wait for the engine to stop, so the host still holds the
// volume for the detach stage after this returns.
func (c *controller) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id missing in request")
	}
	if node == "" {
		// Longhorn detaches from every node then (ForceDetach); the
		// external-attacher always names the node.
		return nil, status.Error(codes.InvalidArgument, "node id missing in request: the Longhorn stand-in does not model a detach from all nodes")
	}
	if _, err := c.s.getVolume(ctx, id); status.Code(err) == codes.NotFound {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	} else if err != nil {
		return nil, err
	}
	ticket := AttachmentID(id, node)
	if err := c.s.setTicket(ctx, id, ticket, node, false); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	gone := func(_ *Volume, va *VolumeAttachment) bool {
		_, ok := va.Spec.AttachmentTickets[ticket]
		return !ok
	}
	if err := c.s.waitFor(ctx, id, gone); err != nil {
		if status.Code(err) == codes.NotFound {
			return &csi.ControllerUnpublishVolumeResponse{}, nil
		}
		if status.Code(err) == codes.DeadlineExceeded && ctx.Err() == nil {
			return nil, status.Errorf(codes.DeadlineExceeded, "Failed to detach volume %s from node %s", id, node)
		}
		return nil, err
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func multiNode(vc *csi.VolumeCapability) bool {
	switch vc.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		return true
	}
	return false
}

// setTicket adds (or removes) a csi-attacher ticket, as the Longhorn API's
// attach and detach actions do.
func (s *Sim) setTicket(ctx context.Context, volume, id, node string, add bool) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		va, err := s.store.getVA(ctx, volume)
		if err != nil {
			return err
		}
		old := clone(va)
		if va.Spec.AttachmentTickets == nil {
			va.Spec.AttachmentTickets = map[string]*AttachmentTicket{}
		}
		_, has := va.Spec.AttachmentTickets[id]
		switch {
		case add && !has:
			va.Spec.AttachmentTickets[id] = &AttachmentTicket{
				ID: id, Type: AttacherTypeCSIAttacher, NodeID: node,
				Parameters: map[string]string{"disableFrontend": "false"}, Generation: 1,
			}
		case !add && has:
			delete(va.Spec.AttachmentTickets, id)
		default:
			return nil
		}
		return s.store.updateVA(ctx, old, va)
	})
}

// waitFor is waitForVolumeState (csi/controller_server.go:1388-1425): it
// looks first after one tick and gives up after the timeout, both scaled.
func (s *Sim) waitFor(ctx context.Context, volume string, cond func(*Volume, *VolumeAttachment) bool) error {
	timeout := time.NewTimer(s.scaled(realPublishTimeout))
	defer timeout.Stop()
	tick := time.NewTicker(max(s.scaled(realPublishTick), time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-timeout.C:
			return status.Error(codes.DeadlineExceeded, "timed out")
		case <-tick.C:
			v, err := s.getVolume(ctx, volume)
			if status.Code(err) == codes.NotFound {
				return err
			}
			if err != nil {
				continue
			}
			va, err := s.store.getVA(ctx, volume)
			if err != nil {
				continue
			}
			if cond(v, va) {
				return nil
			}
		}
	}
}

type nodeServer struct {
	csi.UnimplementedNodeServer
	s    *Sim
	node string
}

func (n *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: n.node}, nil
}

func (n *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME}},
	}}}, nil
}

// attachedHere is Longhorn's attachment check for a v1 data engine
// (csi/node_server.go:157-164).
func (n *nodeServer) attachedHere(ctx context.Context, id string) (*Volume, error) {
	v, err := n.s.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	if !availableOn(v, n.node) {
		return nil, status.Errorf(codes.InvalidArgument, "volume %s hasn't been attached yet", id)
	}
	return v, nil
}

func (n *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	if req.GetVolumeId() == "" || req.GetStagingTargetPath() == "" || req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume id, staging target path and volume capability are required")
	}
	if _, err := n.attachedHere(ctx, req.GetVolumeId()); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (n *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	if req.GetVolumeId() == "" || req.GetStagingTargetPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id and staging target path are required")
	}
	if err := n.releaseDevice(ctx, req.GetVolumeId()); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: release its device: %v", req.GetVolumeId(), err)
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// NodePublishVolume makes Longhorn's checks of csi/node_server.go:157-175:
// attached here, ready, and the workloads list either has a Pending pod or
// only Running ones.
func (n *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" || req.GetTargetPath() == "" || req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume id, target path and volume capability are required")
	}
	v, err := n.attachedHere(ctx, id)
	if err != nil {
		return nil, err
	}
	if !ready(v) {
		return nil, status.Errorf(codes.Aborted, "volume %s is not ready for workloads", id)
	}
	if list := v.Status.KubernetesStatus.WorkloadsStatus; !publishable(list) {
		return nil, status.Errorf(codes.Aborted, "no %v workload pods for volume %v to be mounted: %+v", corev1.PodPending, id, workloadPhases(list))
	}
	if err := n.publishTarget(ctx, id, req.GetTargetPath(), req.GetVolumeCapability().GetBlock() != nil); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: target %s: %v", id, req.GetTargetPath(), err)
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// publishable is NodePublish's workloads check (csi/node_server.go:172-175):
// a Pending pod listed, or every listed pod Running.
func publishable(list []WorkloadStatus) bool {
	phases := workloadPhases(list)
	return len(phases[corev1.PodPending]) > 0 || len(phases[corev1.PodRunning]) == len(list)
}

func workloadPhases(list []WorkloadStatus) map[corev1.PodPhase][]string {
	phases := map[corev1.PodPhase][]string{}
	for _, w := range list {
		phases[corev1.PodPhase(w.PodStatus)] = append(phases[corev1.PodPhase(w.PodStatus)], w.PodName)
	}
	return phases
}

// deviceSize is the size of the file behind a volume's device on a node:
// only the host's view of the volume is modeled, never its data.
const deviceSize = 1 << 20

// publishTarget leaves at the target path what a kubelet expects after
// NodePublish (the CSI spec leaves creating it to the plugin): for a
// filesystem volume a directory; for a block volume the volume's device
// bind-mounted onto a file, as Longhorn's NodePublish does with
// /dev/longhorn/<volume> (longhorn-manager v1.10.1 csi/node_server.go
// nodePublishBlockVolume). A kubelet maps only a device there (kubernetes
// v1.35.4 pkg/volume/util/volumepathhandler IsDeviceBindMountExist).
func (n *nodeServer) publishTarget(ctx context.Context, volume, path string, block bool) error {
	if n.s.opts.DeviceDir == "" {
		return nil // no kubelet behind: only Longhorn's checks
	}
	if !block {
		return os.MkdirAll(path, 0o750)
	}
	dev, err := n.engineDevice(ctx, volume)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o640)
	if err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if isDevice(path) {
		return nil // published before
	}
	return unix.Mount(dev, path, "", unix.MS_BIND, "")
}

// engineDevice is the volume's block device on this node, as Longhorn's
// engine frontend provides one: a loop device over a sparse file in
// Options.DeviceDir, made on first use.
func (n *nodeServer) engineDevice(ctx context.Context, volume string) (string, error) {
	backing := n.backingFile(volume)
	if dev, err := loopOf(ctx, backing); err != nil || dev != "" {
		return dev, err
	}
	if err := os.MkdirAll(filepath.Dir(backing), 0o750); err != nil {
		return "", err
	}
	f, err := os.OpenFile(backing, os.O_CREATE|os.O_WRONLY, 0o640)
	if err != nil {
		return "", err
	}
	if err := errors.Join(f.Truncate(deviceSize), f.Close()); err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, "losetup", "--find", "--show", backing).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("losetup %s: %w: %s", backing, err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

func (n *nodeServer) backingFile(volume string) string {
	return filepath.Join(n.s.opts.DeviceDir, n.node, volume)
}

// releaseDevice stops the volume's device on this node, as the engine
// frontend goes when Longhorn detaches the volume from it.
func (n *nodeServer) releaseDevice(ctx context.Context, volume string) error {
	if n.s.opts.DeviceDir == "" {
		return nil
	}
	backing := n.backingFile(volume)
	for {
		dev, err := loopOf(ctx, backing)
		if err != nil {
			return err
		}
		if dev == "" {
			break
		}
		if out, err := exec.CommandContext(ctx, "losetup", "-d", dev).CombinedOutput(); err != nil {
			return fmt.Errorf("losetup -d %s: %w: %s", dev, err, out)
		}
	}
	if err := os.Remove(backing); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// loopOf is the first loop device over file, or "".
func loopOf(ctx context.Context, file string) (string, error) {
	out, err := exec.CommandContext(ctx, "losetup", "-j", file).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("losetup -j %s: %w: %s", file, err, out)
	}
	dev, _, _ := strings.Cut(strings.TrimSpace(string(out)), ":")
	return dev, nil
}

func isDevice(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode()&os.ModeDevice != 0
}

func (n *nodeServer) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" || req.GetTargetPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id and target path are required")
	}
	// The kubelet has unmapped it by now; what is left is the plugin's own
	// bind mount and the target. Not removed recursively: a target someone
	// else still has mounted must fail here rather than lose what it holds.
	target := req.GetTargetPath()
	if n.s.opts.DeviceDir == "" {
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if isDevice(target) {
		if err := unix.Unmount(target, 0); err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: unmount target %s: %v", req.GetVolumeId(), target, err)
		}
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "volume %s: remove target %s: %v", req.GetVolumeId(), req.GetTargetPath(), err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}
