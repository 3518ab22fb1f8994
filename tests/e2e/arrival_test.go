package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestStageOfDisksStillArriving (harvester 10217): three claims of one node
// are staged at once while their disks are still on their way (the VM's
// attachment pod has not started). Each stage waits within its call and,
// when the call's deadline comes first, answers Unavailable naming its
// volume, before that deadline, through the node's gRPC socket as kubelet
// sees it. Once the disks are there, kubelet's first retry of each stage
// mounts it, and the volumes publish and hold data.
func TestStageOfDisksStillArriving(t *testing.T) {
	nodetest.RequireRealDevices(t)
	work := t.TempDir()
	nodetest.CleanupMounts(t, work)
	h, disks := framework.StartHostWithDisks(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05, BindClasslessPVCs: true})
	vm := "guest-arrive"
	h.CreateVMs(t, vm)
	vols := h.CreateVolumes(t, "pvc-arrive", 3)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 20 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})
	node := serveNode(t, driver.NodeOptions{NodeID: vm, ByIDDir: disks.ByIDDir(h.Namespace + "/" + vm), SweepInterval: -1})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	capability := ext4Capability()
	staging := func(vol string) string { return filepath.Join(work, vol, "globalmount") }
	for _, vol := range vols {
		if err := os.MkdirAll(staging(vol), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	stageAll := func(deadline time.Duration) []error {
		errs := make([]error, len(vols))
		var wg sync.WaitGroup
		for i, vol := range vols {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cctx, c := context.WithTimeout(ctx, deadline)
				defer c()
				_, errs[i] = node.NodeStageVolume(cctx, &csi.NodeStageVolumeRequest{VolumeId: vol, StagingTargetPath: staging(vol), VolumeCapability: capability})
			}()
		}
		wg.Wait()
		return errs
	}

	// The attachment pod does not start yet: the publishes are in flight.
	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, vm, true)
	published := make(chan error, len(vols))
	for _, vol := range vols {
		go func() {
			_, err := ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: capability})
			published <- err
		}()
	}
	ctrl.WaitQueued(t, vm, len(vols))
	for i, err := range stageAll(4 * time.Second) {
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), vols[i]) {
			t.Errorf("stage of %s whose disk is still arriving = %v, want Unavailable naming the volume, answered before the deadline", vols[i], err)
		}
	}

	// The disks arrive.
	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, vm, false)
	for range vols {
		if err := <-published; err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
	for i, err := range stageAll(2 * time.Minute) {
		if err != nil {
			t.Errorf("first retry of the stage of %s after its disk appeared: %v", vols[i], err)
		}
	}
	if t.Failed() {
		return
	}
	for _, vol := range vols {
		target := filepath.Join(work, vol, "pod", "mount")
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			t.Fatal(err)
		}
		if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol, StagingTargetPath: staging(vol), TargetPath: target, VolumeCapability: capability}); err != nil {
			t.Fatalf("node publish %s: %v", vol, err)
		}
		file := filepath.Join(target, "data")
		nodetest.WriteRandom(t, file, 1<<20, 7)
		sum := nodetest.Checksum(t, file)
		if got := nodetest.Checksum(t, filepath.Join(staging(vol), "data")); got != sum {
			t.Errorf("%s: the staging mount does not hold what the pod wrote", vol)
		}
		if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol, TargetPath: target}); err != nil {
			t.Fatalf("node unpublish %s: %v", vol, err)
		}
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol, StagingTargetPath: staging(vol)}); err != nil {
			t.Fatalf("unstage %s: %v", vol, err)
		}
		if _, err := ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: vm}); err != nil {
			t.Fatalf("unpublish %s: %v", vol, err)
		}
	}
}

// serveNode serves a node service on a unix socket, as the DaemonSet does
// for kubelet, and returns a client of it: deadlines then behave as kubelet
// sees them (a late answer is the caller's own DeadlineExceeded).
func serveNode(t *testing.T, opts driver.NodeOptions) csi.NodeClient {
	t.Helper()
	n, err := driver.NewNodeService(opts)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "hcsi-node-") // unix socket paths must stay short
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = driver.New("test", nil, n).Serve(ctx, endpoint) }()
	t.Cleanup(func() { cancel(); <-done })
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	client := csi.NewNodeClient(conn)
	nodetest.Eventually(t, "the node socket to answer", func() bool {
		_, err := client.NodeGetCapabilities(context.Background(), &csi.NodeGetCapabilitiesRequest{})
		return err == nil
	})
	return client
}
