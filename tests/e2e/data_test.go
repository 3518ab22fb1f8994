// Package e2e drives the whole driver the way Kubernetes does, controller and
// node together, over the KubeVirt simulator whose hot-plugged disks are real
// loop devices: what a workload wrote must survive detach and re-attach.
package e2e

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

func TestMain(m *testing.M) { nodetest.Main(m) }

// guest is one guest node: its VM on the host and its node plugin.
type guest struct {
	vm   string
	node csi.NodeServer
}

func TestDataSurvivesMoveBetweenNodes(t *testing.T) {
	nodetest.RequireRealDevices(t)
	for _, mode := range []kubevirtsim.Mode{kubevirtsim.ModeLegacy, kubevirtsim.ModeDeclarative} {
		t.Run(string(mode), func(t *testing.T) { moveBetweenNodes(t, mode) })
	}
}

func moveBetweenNodes(t *testing.T, mode kubevirtsim.Mode) {
	work := t.TempDir()
	h, disks, guests, ctrl := twoGuests(t, kubevirtsim.Options{Mode: mode, BindClasslessPVCs: true}, driver.ControllerOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	capability := ext4Capability()
	vol, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-e2e-data", VolumeCapabilities: []*csi.VolumeCapability{capability},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.Volume.VolumeId

	var sum string
	for round, g := range guests {
		mountOn(ctx, t, ctrl, disks, h.Namespace, work, g, id, capability, func(dir string) {
			file := filepath.Join(dir, "data.bin")
			if round == 0 {
				nodetest.WriteRandom(t, file, 8<<20, 42)
				sum = nodetest.Checksum(t, file)
			} else if got := nodetest.Checksum(t, file); got != sum {
				t.Fatalf("data read on %s differs from what %s wrote: %s != %s", g.vm, guests[0].vm, got, sum)
			}
		})
	}
	if _, err := ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatalf("delete: %v", err)
	}
}

// twoGuests starts a simulated host whose disks are loop devices, two guest
// VMs with a node plugin each, and the controller.
func twoGuests(t *testing.T, opts kubevirtsim.Options, drv driver.ControllerOptions) (*framework.Host, *loopdisk.LoopDisks, []guest, *framework.Controller) {
	t.Helper()
	opts.Version, opts.Scale = kubevirtsim.V1_7_0, 0.05
	h, disks := framework.StartHostWithDisks(t, opts)
	guests := []guest{{vm: "guest-a"}, {vm: "guest-b"}}
	for i := range guests {
		h.CreateVMs(t, guests[i].vm)
		n, err := driver.NewNodeService(driver.NodeOptions{NodeID: guests[i].vm, ByIDDir: disks.ByIDDir(h.Namespace + "/" + guests[i].vm), SweepInterval: -1})
		if err != nil {
			t.Fatal(err)
		}
		guests[i].node = n
	}
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Driver: drv,
		Queue: hotplug.Config{BatchWindow: 20 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})
	return h, disks, guests, ctrl
}

func ext4Capability() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// mountOn attaches the volume to g's VM, stages and publishes it there, runs
// use on the mounted directory, and undoes it all in kubelet's and the
// attacher's order, checking the disk really left the VM.
func mountOn(ctx context.Context, t *testing.T, ctrl *framework.Controller, disks *loopdisk.LoopDisks, ns, work string, g guest, id string, capability *csi.VolumeCapability, use func(dir string)) {
	t.Helper()
	staging := filepath.Join(work, g.vm, id, "staging")
	target := filepath.Join(work, g.vm, id, "target")
	if _, err := ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: g.vm, VolumeCapability: capability}); err != nil {
		t.Fatalf("publish %s to %s: %v", id, g.vm, err)
	}
	if _, err := g.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: capability}); err != nil {
		t.Fatalf("stage %s on %s: %v", id, g.vm, err)
	}
	if _, err := g.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: capability}); err != nil {
		t.Fatalf("node publish %s on %s: %v", id, g.vm, err)
	}
	use(target)
	if _, err := g.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatalf("node unpublish %s on %s: %v", id, g.vm, err)
	}
	if _, err := g.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("unstage %s on %s: %v", id, g.vm, err)
	}
	if _, err := ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: g.vm}); err != nil {
		t.Fatalf("unpublish %s from %s: %v", id, g.vm, err)
	}
	if dev, ok := disks.Device(ns+"/"+g.vm, id); ok {
		t.Fatalf("unpublish answered OK while %s still has the disk as %s", g.vm, dev)
	}
}

// sourceWithData creates a 64 MiB volume, writes 8 MiB of random data (from
// seed) to it through g, and returns its ID and the data's checksum: the
// source of a snapshot or clone whose copy is read back later.
func sourceWithData(ctx context.Context, t *testing.T, ctrl *framework.Controller, disks *loopdisk.LoopDisks, ns, work string, g guest, name string, seed byte) (id, checksum string) {
	t.Helper()
	capability := ext4Capability()
	src, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: name, VolumeCapabilities: []*csi.VolumeCapability{capability},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	id = src.GetVolume().GetVolumeId()
	mountOn(ctx, t, ctrl, disks, ns, work, g, id, capability, func(dir string) {
		nodetest.WriteRandom(t, filepath.Join(dir, "data.bin"), 8<<20, seed)
		checksum = nodetest.Checksum(t, filepath.Join(dir, "data.bin"))
	})
	return id, checksum
}
