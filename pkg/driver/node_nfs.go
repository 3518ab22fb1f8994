package driver

import (
	"context"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
)

// A ReadWriteMany volume reaches the node as an NFS export of Harvester's
// networkfs-manager: ControllerPublish puts its address in the publish
// context, NodeStage mounts it at the staging path, NodePublish binds that
// into the pod. The same path rules hold as for disks: clean absolute paths,
// "--" before operands, no symlink followed at a mount target.

// stageNFS mounts the export at the staging path, or finds it mounted.
func (s *NodeService) stageNFS(ctx context.Context, id, staging string, capability *csi.VolumeCapability, pc map[string]string) error {
	logger := klog.FromContext(ctx)
	if pc[nfsEndpointKey] == "" && s.opts.Exports != nil {
		// Attached by upstream's driver, whose publish said nothing: ask
		// the host, as upstream's node does.
		lookupCtx, cancel := context.WithTimeout(ctx, hostCallTimeout)
		endpoint, export, opts, err := s.opts.Exports.NFSExport(lookupCtx, id)
		cancel()
		if err != nil {
			return status.Errorf(codes.Unavailable, "volume %s: no NFS export in the publish context, and the host does not tell one: %v", id, err)
		}
		pc = map[string]string{nfsEndpointKey: endpoint, nfsExportKey: export, nfsOptionsKey: opts}
	}
	source, err := mounter.NFSSource(pc[nfsEndpointKey], pc[nfsExportKey])
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "volume %s: the publish context names no usable NFS export (ControllerPublishVolume sets it): %v", id, err)
	}
	options := mounter.NFSOptions(capability.GetMount().GetMountFlags(), pc[nfsOptionsKey])
	if readOnlyMode(capability) {
		options = append(options, "ro")
	}
	mnt, mounted, err := s.mounter.MountAt(staging)
	if err != nil {
		return toStatus(err)
	}
	if mounted {
		if mounter.IsNFS(mnt.FSType) && mounter.SameNFSSource(mnt.Source, source) {
			logger.V(2).Info("NFS export already staged", "source", source, "path", staging)
			return nil
		}
		return status.Errorf(codes.AlreadyExists, "volume %s: staging path %s already has %s (%s) mounted, not the volume's NFS export %s", id, staging, mnt.Source, mnt.FSType, source)
	}
	if err := s.mounter.Mount(ctx, source, staging, "nfs", options); err != nil {
		// The export may not serve yet or any more (networkfs-manager moves
		// it): kubelet retries the stage.
		return status.Errorf(codes.Unavailable, "volume %s: %v", id, err)
	}
	logger.Info("NFS export staged", "source", source, "path", staging, "options", strings.Join(options, ","))
	return nil
}

// publishNFS binds the staged export into the pod's target path.
func (s *NodeService) publishNFS(ctx context.Context, id, staging, target string, capability *csi.VolumeCapability, readOnly bool) error {
	stagedMnt, staged, err := s.mounter.MountAt(staging)
	if err != nil {
		return toStatus(err)
	}
	if !staged || !mounter.IsNFS(stagedMnt.FSType) {
		return status.Errorf(codes.FailedPrecondition, "volume %s: staging path %s has no NFS mount: the volume is not staged on this node", id, staging)
	}
	stagedDev := device.Device{Path: stagedMnt.Source, Major: stagedMnt.Major, Minor: stagedMnt.Minor}
	if done, err := s.checkExistingPublish(target, stagedDev, readOnly); err != nil || done {
		return err
	}
	if err := mounter.EnsureDir(target); err != nil {
		return toStatus(err)
	}
	if err := s.mounter.BindMount(ctx, staging, target, readOnly, capability.GetMount().GetMountFlags()); err != nil {
		return toStatus(err)
	}
	s.published.add(id, target)
	klog.FromContext(ctx).Info("NFS volume published", "source", stagedMnt.Source, "target", target, "readOnly", readOnly)
	return nil
}

// unstageNFS unmounts a staged export. Kubelet unstages after every publish
// of the node is gone, so nothing uses the mount; a server that no longer
// answers must not keep it forever, hence the lazy fallback.
func (s *NodeService) unstageNFS(ctx context.Context, staging, source string) error {
	logger := klog.FromContext(ctx)
	if err := s.mounter.Unmount(ctx, staging); err != nil {
		logger.Info("unmounting the NFS export failed; detaching it lazily", "path", staging, "err", err.Error())
		if err := s.mounter.LazyUnmount(ctx, staging); err != nil {
			return toStatus(err)
		}
	}
	logger.Info("NFS export unstaged", "source", source, "path", staging)
	return nil
}

// nfsStatsWait bounds a statfs of an NFS mount: with a hard mount and a
// server gone it never returns.
const nfsStatsWait = 10 * time.Second

// nfsVolumeStats answers NodeGetVolumeStats for an NFS mount of the volume
// at path (handled false: not one).
func (s *NodeService) nfsVolumeStats(ctx context.Context, id, path string) (*csi.NodeGetVolumeStatsResponse, bool, error) {
	if !cleanAbs(path) {
		return nil, false, nil
	}
	mnt, ok, err := s.mounter.MountAt(path)
	if err != nil || !ok || !mounter.IsNFS(mnt.FSType) {
		return nil, false, nil
	}
	// After a restart the book of published paths is empty: kubelet's own
	// paths name the volume (.../kubernetes.io~csi/<volume>/mount).
	if owner, known := s.published.owner(path); (known && owner != id) || (!known && !strings.Contains(path, "/"+id+"/")) {
		return nil, false, nil
	}
	type result struct {
		st  mounter.Stats
		err error
	}
	done := make(chan result, 1)
	go func() {
		st, err := mounter.FSStats(path)
		done <- result{st, err}
	}()
	ctx, cancel := context.WithTimeout(ctx, nfsStatsWait)
	defer cancel()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, true, toStatus(r.err)
		}
		return &csi.NodeGetVolumeStatsResponse{
			Usage: []*csi.VolumeUsage{
				{Unit: csi.VolumeUsage_BYTES, Total: r.st.TotalBytes, Available: r.st.AvailableBytes, Used: r.st.UsedBytes},
				{Unit: csi.VolumeUsage_INODES, Total: r.st.TotalInodes, Available: r.st.FreeInodes, Used: r.st.UsedInodes},
			},
			VolumeCondition: &csi.VolumeCondition{Message: "NFS export " + mnt.Source + " mounted"},
		}, true, nil
	case <-ctx.Done():
		return &csi.NodeGetVolumeStatsResponse{VolumeCondition: &csi.VolumeCondition{Abnormal: true,
			Message: "NFS export " + mnt.Source + " does not answer: statfs took longer than " + nfsStatsWait.String()}}, true, nil
	}
}
