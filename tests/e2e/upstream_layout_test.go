package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/internal/proc"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestUpstreamLayout runs the driver binary the way upstream's chart (and
// RKE2's bundled copy of it, which deploy/rke2's HelmChartConfig points at
// this image) runs it: one process per node with the DaemonSet's arguments
// (harvester/charts charts/harvester-csi-driver templates/daemonset.yaml:
// --nodeid, --endpoint=unix:///csi/csi.sock,
// --kubeconfig=/var/lib/harvester/cloud-provider-config, no --mode), serving
// the controller and the node service on one socket, and the real
// external-attacher with upstream's arguments (templates/deployment.yaml:
// --timeout=1m50s, leader election, default --worker-threads) connected to
// that same socket. VolumeAttachments for several volumes end attached and
// Ready on the VM, the node stages one of them from the hot-plugged disk,
// and deleting them detaches every volume.
func TestUpstreamLayout(t *testing.T) {
	nodetest.RequireRealDevices(t)
	const n = 4
	h, disks := framework.StartHostWithDisks(t, kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Version: kubevirtsim.V1_5_3, Scale: 0.05, BindClasslessPVCs: true})
	vm := "guest-node-1"
	h.CreateVMs(t, vm)
	vols := h.CreateVolumes(t, "pvc-upstream", n)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	guestEnv, guest := g.Env, g.Kube

	// The pod's paths, under a short root (unix socket paths are limited).
	root, err := os.MkdirTemp("", "hcsi-up-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	hostKubeconfig := filepath.Join(root, "var", "lib", "harvester", "cloud-provider-config")
	sock := filepath.Join(root, "csi", "csi.sock")
	kubeletRoot := filepath.Join(root, "kubelet")
	for _, d := range []string{filepath.Dir(hostKubeconfig), filepath.Dir(sock), kubeletRoot} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Sim.WriteKubeconfig(ctx, hostKubeconfig, h.Namespace); err != nil {
		t.Fatal(err)
	}
	startUpstreamDaemonSetDriver(t, root, []string{
		// The DaemonSet's arguments, NODE_ID being the node's name, which
		// on RKE2 provisioned by Rancher is the VM's name.
		"--nodeid=" + vm, "--endpoint=unix://" + sock, "--kubeconfig=" + hostKubeconfig,
		// What the pod gives the process besides: its in-cluster guest
		// credentials (upstream's ServiceAccount), which a process outside
		// a pod gets as a file, and the host paths the DaemonSet mounts
		// where the driver looks by default, here under the test's root.
		"--guest-kubeconfig=" + guestEnv.Kubeconfig,
		"--by-id-dir=" + disks.ByIDDir(h.Namespace+"/"+vm), "--kubelet-root-dir=" + kubeletRoot,
	})
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	testwait.Until(ctx, t, "the driver ready on the node socket", func() (bool, string) {
		resp, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		return err == nil && resp.GetReady().GetValue(), fmt.Sprintf("%v %v", resp, err)
	})
	// One process serves both services on the DaemonSet's socket.
	caps, err := csi.NewIdentityClient(conn).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(caps.GetCapabilities(), func(c *csi.PluginCapability) bool {
		return c.GetService().GetType() == csi.PluginCapability_Service_CONTROLLER_SERVICE
	}) {
		t.Fatalf("the node socket does not offer the controller service: %v", caps)
	}
	node := csi.NewNodeClient(conn)
	info, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil || info.GetNodeId() != vm {
		t.Fatalf("NodeGetInfo on the same socket: %v %v, want node ID %s", info, err, vm)
	}

	registerNode(ctx, t, guest, vm, vm, vols)
	// Upstream's csi-attacher container, arguments as its template writes
	// them; the namespace is the release's.
	if err := guestEnv.Run("csi-attacher", "--v=5", "--csi-address="+sock, "--timeout=1m50s",
		"--leader-election", "--leader-election-namespace=kube-system", "--kubeconfig="+guestEnv.Kubeconfig); err != nil {
		t.Fatal(err)
	}
	attachAll(ctx, t, h, guest, vm, vm, vols)

	// kubelet's part, on the same process: stage the first volume from the
	// disk that arrived on the VM, then unstage it.
	staging := filepath.Join(kubeletRoot, "plugins", "kubernetes.io", "csi", driver.Name, "upstream-layout", "globalmount")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vols[0], StagingTargetPath: staging, VolumeCapability: ext4Capability()}); err != nil {
		t.Fatalf("stage %s: %v", vols[0], err)
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(mounts), " "+staging+" ") {
		t.Errorf("NodeStageVolume answered OK but %s is not a mount point", staging)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vols[0], StagingTargetPath: staging}); err != nil {
		t.Fatalf("unstage %s: %v", vols[0], err)
	}

	detachAll(ctx, t, guest, vols)
	for _, vol := range vols {
		if dev, ok := disks.Device(h.Namespace+"/"+vm, vol); ok {
			t.Errorf("VolumeAttachment of %s gone while the VM still has the disk as %s", vol, dev)
		}
	}
}

// startUpstreamDaemonSetDriver builds the driver binary and runs it with
// args as one process, logging under dir; it is stopped as kubelet stops a
// container (SIGTERM) when the test ends.
func startUpstreamDaemonSetDriver(t *testing.T, dir string, args []string) {
	t.Helper()
	bin := framework.BuildDriver(t, dir)
	framework.StartProcess(t, dir, proc.Spec{Name: "driver", Path: bin, Args: args})
}
