package node

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/nodeid"
)

// plainNode is a node service over empty fixture directories: enough for
// request validation, which must not need root.
func plainNode(t *testing.T, mutate func(*driver.NodeOptions)) csi.NodeServer {
	t.Helper()
	dir := t.TempDir()
	opts := driver.NodeOptions{
		NodeID: "vm-a", ByIDDir: filepath.Join(dir, "by-id"), SysfsRoot: filepath.Join(dir, "sys"),
		DeviceWait: 300 * time.Millisecond, DevicePollInterval: 20 * time.Millisecond, SweepInterval: -1,
	}
	if err := os.MkdirAll(opts.ByIDDir, 0o750); err != nil {
		t.Fatal(err)
	}
	if mutate != nil {
		mutate(&opts)
	}
	ns, err := driver.NewNodeService(opts)
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

func TestRequestValidation(t *testing.T) {
	ns := plainNode(t, nil)
	ctx := testContext(t)
	dir := t.TempDir()
	c := mountCap("ext4", rwo)
	missing := filepath.Join(dir, "missing")
	call := map[string]func() error{
		"stage without volume ID": func() error {
			_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{StagingTargetPath: dir, VolumeCapability: c})
			return err
		},
		"stage without staging path": func() error {
			_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", VolumeCapability: c})
			return err
		},
		"stage without capability": func() error {
			_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: dir})
			return err
		},
		"stage with capability without access type": func() error {
			_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: dir,
				VolumeCapability: &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: rwo}}})
			return err
		},
		"stage with an unsupported filesystem": func() error {
			_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: dir, VolumeCapability: mountCap("btrfs", rwo)})
			return err
		},
		"stage multi-node": func() error {
			_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: dir,
				VolumeCapability: mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)})
			return err
		},
		"unstage without volume ID": func() error {
			_, err := ns.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{StagingTargetPath: dir})
			return err
		},
		"unstage without staging path": func() error {
			_, err := ns.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "v"})
			return err
		},
		"publish without volume ID": func() error {
			_, err := ns.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{StagingTargetPath: dir, TargetPath: missing, VolumeCapability: c})
			return err
		},
		"publish without target": func() error {
			_, err := ns.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: dir, VolumeCapability: c})
			return err
		},
		"publish without capability": func() error {
			_, err := ns.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: dir, TargetPath: missing})
			return err
		},
		"publish without staging path": func() error {
			_, err := ns.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", TargetPath: missing, VolumeCapability: c})
			return err
		},
		"unpublish without volume ID": func() error {
			_, err := ns.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{TargetPath: missing})
			return err
		},
		"unpublish without target": func() error {
			_, err := ns.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v"})
			return err
		},
		"stats without volume ID": func() error {
			_, err := ns.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumePath: dir})
			return err
		},
		"stats without path": func() error {
			_, err := ns.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "v"})
			return err
		},
		"expand without volume ID": func() error {
			_, err := ns.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumePath: dir})
			return err
		},
		"expand without path": func() error {
			_, err := ns.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "v"})
			return err
		},
	}
	for name, f := range call {
		t.Run(name, func(t *testing.T) { wantCode(t, f(), codes.InvalidArgument, name) })
	}

	notFound := map[string]func() error{
		"stats of a path that does not exist": func() error {
			_, err := ns.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: missing})
			return err
		},
		"stats of a path where nothing is mounted": func() error {
			_, err := ns.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: dir})
			return err
		},
		"expand of a path that does not exist": func() error {
			_, err := ns.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: "some/path"})
			return err
		},
	}
	for name, f := range notFound {
		t.Run(name, func(t *testing.T) { wantCode(t, f(), codes.NotFound, name) })
	}

	// Tearing down what is not there succeeds.
	_, err := ns.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: missing})
	must(t, err, "unpublish of a missing target")
	_, err = ns.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: missing})
	must(t, err, "unstage of a missing staging path")
}

// A disk that does not show up ends the wait with Unavailable (it may still
// be on its way: harvester 10217), saying what was looked for and where; the
// wait ends at the configured bound or a little before the caller's
// deadline, whichever comes first.
func TestStageWithoutDiskIsUnavailable(t *testing.T) {
	ns := plainNode(t, nil)
	ctx := testContext(t)
	staging := t.TempDir()
	start := time.Now()
	_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-nowhere", StagingTargetPath: staging,
		VolumeCapability: mountCap("", rwo)})
	wantCode(t, err, codes.Unavailable, "stage without disk")
	for _, want := range []string{"pvc-nowhere", "by-id", "scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-nowhere", "waiting"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q lacks %q", err, want)
		}
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("gave up after %s, before the configured 300ms", d)
	}

	patient := plainNode(t, func(o *driver.NodeOptions) { o.DeviceWait = time.Hour })
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = patient.NodeStageVolume(dctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-nowhere", StagingTargetPath: staging,
		VolumeCapability: mountCap("", rwo)})
	wantCode(t, err, codes.Unavailable, "stage without disk, ended by the caller's deadline")
}

// Two operations on one volume: the second is told to come back. The stage
// waits for a disk that never comes until the test ends it, and the unstage
// is asked again until it meets the stage, however slowly the stage starts
// (a stage that met an unstage first is Aborted itself and started again).
func TestConcurrentOperationOnVolumeIsAborted(t *testing.T) {
	ns := plainNode(t, func(o *driver.NodeOptions) { o.DeviceWait = time.Hour })
	ctx := testContext(t)
	stageCtx, endStage := context.WithCancel(ctx)
	defer endStage()
	staging := t.TempDir()
	done := make(chan error, 1)
	stage := func() {
		go func() {
			_, err := ns.NodeStageVolume(stageCtx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-x", StagingTargetPath: staging, VolumeCapability: mountCap("", rwo)})
			done <- err
		}()
	}
	stage()
	var err error
	nodetest.Eventually(t, "an unstage to meet the running stage", func() bool {
		select {
		case err := <-done:
			wantCode(t, err, codes.Aborted, "a stage that ended before the test ended it")
			stage()
		default:
		}
		_, err = ns.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pvc-x", StagingTargetPath: staging})
		return status.Code(err) != codes.OK
	})
	wantCode(t, err, codes.Aborted, "unstage during stage")
	endStage()
	wantCode(t, <-done, codes.Canceled, "the stage")
	_, err = ns.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pvc-x", StagingTargetPath: staging})
	must(t, err, "unstage afterwards")
}

func TestCapabilities(t *testing.T) {
	ns := plainNode(t, nil)
	resp, err := ns.NodeGetCapabilities(testContext(t), &csi.NodeGetCapabilitiesRequest{})
	must(t, err, "capabilities")
	got := map[csi.NodeServiceCapability_RPC_Type]bool{}
	for _, c := range resp.GetCapabilities() {
		got[c.GetRpc().GetType()] = true
	}
	for _, want := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME, csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME, csi.NodeServiceCapability_RPC_VOLUME_CONDITION,
		// ReadWriteOncePod claims reach the driver as SINGLE_NODE_SINGLE_WRITER
		// only when the node says it knows the new modes.
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		if !got[want] {
			t.Errorf("missing capability %s", want)
		}
	}
	if len(got) != 5 {
		t.Errorf("unexpected capabilities %v", got)
	}
}

type fakeVMIs struct {
	vmis  []nodeid.VMI
	calls int
}

func (f *fakeVMIs) GetVMI(_ context.Context, name string) (*nodeid.VMI, error) {
	f.calls++
	for i := range f.vmis {
		if f.vmis[i].Name == name {
			return &f.vmis[i], nil
		}
	}
	return nil, nil
}

func (f *fakeVMIs) ListVMIs(context.Context) ([]nodeid.VMI, error) {
	f.calls++
	return f.vmis, nil
}

func writeSysfsNet(t *testing.T, root string, ifaces map[string]string) {
	t.Helper()
	for name, mac := range ifaces {
		dir := filepath.Join(root, "class", "net", name)
		must(t, os.MkdirAll(dir, 0o750), "mkdir")
		must(t, os.WriteFile(filepath.Join(dir, "address"), []byte(mac+"\n"), 0o640), "write address")
	}
}

func TestNodeGetInfo(t *testing.T) {
	sys := t.TempDir()
	writeSysfsNet(t, sys, map[string]string{"lo": "00:00:00:00:00:00", "cali1": "ee:ee:ee:ee:ee:ee", "enp1s0": "52:54:00:AA:BB:CC"})
	vmis := &fakeVMIs{vmis: []nodeid.VMI{
		{Name: "a-other", MACs: []string{"ee:ee:ee:ee:ee:ee"}}, // Calico's MAC matches nothing
		{Name: "guest-vm-2", MACs: []string{"52-54-00-aa-bb-cc"}},
	}}
	ns := plainNode(t, func(o *driver.NodeOptions) {
		o.NodeID, o.SysfsRoot, o.Hostname, o.VMIs, o.MaxVolumesPerNode = "", sys, "guest-host", vmis, 30
	})
	ctx := testContext(t)
	resp, err := ns.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	must(t, err, "NodeGetInfo")
	if resp.GetNodeId() != "guest-vm-2" || resp.GetMaxVolumesPerNode() != 30 {
		t.Fatalf("got %v", resp)
	}
	calls := vmis.calls
	resp, err = ns.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	must(t, err, "NodeGetInfo again")
	if resp.GetNodeId() != "guest-vm-2" || vmis.calls != calls {
		t.Fatalf("second call should reuse the discovered ID: %v, %d lookups", resp, vmis.calls-calls)
	}

	// --nodeid wins without asking the host.
	vmis.calls = 0
	ns = plainNode(t, func(o *driver.NodeOptions) { o.NodeID, o.SysfsRoot, o.VMIs = "pinned", sys, vmis })
	resp, err = ns.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	must(t, err, "NodeGetInfo with --nodeid")
	if resp.GetNodeId() != "pinned" || vmis.calls != 0 {
		t.Fatalf("got %v after %d lookups", resp, vmis.calls)
	}
}

// NodeGetInfo reports the room KubeVirt's limit of 256 disks leaves on the
// node's VM: the guest's own disks (root, cloud-init CD-ROM) take slots,
// hot-plugged volumes do not (the scheduler counts those), loop devices are
// no disks of the VM; --max-volumes-per-node caps it; the count is read again
// at every call, as kubelet's periodic refresh needs.
func TestNodeGetInfoReportsTheVMsRoom(t *testing.T) {
	sys, byID := t.TempDir(), t.TempDir()
	disk := func(name string, real bool) {
		dir := filepath.Join(sys, "block", name)
		must(t, os.MkdirAll(dir, 0o750), "mkdir")
		if real {
			must(t, os.WriteFile(filepath.Join(dir, "device"), nil, 0o640), "write device")
		}
	}
	disk("vda", true)
	disk("sr0", true)
	disk("sda", true)
	disk("loop0", false)
	must(t, os.Symlink("../../sda", filepath.Join(byID, "scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-1")), "link")
	ctx := testContext(t)
	for _, tc := range []struct {
		limit, want int64
		extra       string // a disk added to the VM before the call
	}{{want: 254}, {limit: 30, want: 30}, {want: 253, extra: "vdb"}} {
		if tc.extra != "" {
			disk(tc.extra, true)
		}
		ns := plainNode(t, func(o *driver.NodeOptions) {
			o.NodeID, o.SysfsRoot, o.ByIDDir, o.MaxVolumesPerNode = "vm-1", sys, byID, tc.limit
		})
		resp, err := ns.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		must(t, err, "NodeGetInfo")
		if resp.GetMaxVolumesPerNode() != tc.want {
			t.Errorf("cap %d, extra disk %q: max volumes %d, want %d", tc.limit, tc.extra, resp.GetMaxVolumesPerNode(), tc.want)
		}
	}
}
