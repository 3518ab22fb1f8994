package node

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
)

func TestMain(m *testing.M) { nodetest.Main(m) }

const mib = int64(1) << 20

// harness is one test's "cluster": loop disks standing in for hot-plugged
// volumes, and per-VM by-id and kubelet directories.
type harness struct {
	t     *testing.T
	root  string
	disks *loopdisk.LoopDisks
	size  int64
}

func newHarness(t *testing.T, size int64, tools ...string) *harness {
	t.Helper()
	nodetest.RequireRealDevices(t, tools...)
	root := t.TempDir()
	h := &harness{t: t, root: root, size: size}
	disks, err := loopdisk.New(loopdisk.Options{
		BackingDir: filepath.Join(root, "host"),
		ByIDRoot:   filepath.Join(root, "by-id"),
		Size:       func(context.Context, string) (int64, error) { return h.size, nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	h.disks = disks
	// Cleanups run last-in first-out: unmount, then detach, then TempDir.
	t.Cleanup(func() {
		if err := disks.Close(context.Background()); err != nil {
			t.Errorf("detach loop disks: %v", err)
		}
	})
	nodetest.CleanupMounts(t, root)
	return h
}

func testContext(t *testing.T) context.Context {
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

type events struct {
	mu  sync.Mutex
	got []string
}

func (e *events) Event(_ context.Context, volumeID, eventType, reason, message string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.got = append(e.got, strings.Join([]string{volumeID, eventType, reason, message}, "|"))
}

func (e *events) list() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.got...)
}

type node struct {
	*driver.NodeService
	vm     string
	events *events
	h      *harness
}

func (h *harness) node(vm string, mutate func(*driver.NodeOptions)) *node {
	h.t.Helper()
	ev := &events{}
	opts := driver.NodeOptions{
		NodeID:               vm,
		ByIDDir:              h.disks.ByIDDir(vm),
		KubeletRoot:          h.kubeletRoot(vm),
		DeviceWait:           2 * time.Second,
		DevicePollInterval:   50 * time.Millisecond,
		InUseRecheckInterval: 200 * time.Millisecond,
		SweepInterval:        100 * time.Millisecond,
		SweepConfirm:         50 * time.Millisecond,
		Events:               ev,
	}
	if mutate != nil {
		mutate(&opts)
	}
	ns, err := driver.NewNodeService(opts)
	if err != nil {
		h.t.Fatal(err)
	}
	return &node{NodeService: ns, vm: vm, events: ev, h: h}
}

// kubeletRoot is vm's kubelet root directory.
func (h *harness) kubeletRoot(vm string) string { return filepath.Join(h.root, "kubelet-"+vm) }

// paths returns kubelet-style staging and target paths of vol on n. Kubelet
// creates the staging directory and the target's parent.
func (n *node) paths(vol, pod string) (staging, target string) {
	kubelet := n.h.kubeletRoot(n.vm)
	staging = filepath.Join(kubelet, "plugins/kubernetes.io/csi", driver.Name, vol, "globalmount")
	target = filepath.Join(kubelet, "pods", pod, "volumes/kubernetes.io~csi", vol, "mount")
	for _, d := range []string{staging, filepath.Dir(target)} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			n.h.t.Fatal(err)
		}
	}
	return staging, target
}

func (h *harness) plug(vm, vol string) string {
	h.t.Helper()
	if err := h.disks.Plug(testContext(h.t), vm, vol, vol); err != nil {
		h.t.Fatal(err)
	}
	dev, ok := h.disks.Device(vm, vol)
	if !ok {
		h.t.Fatalf("%s not plugged into %s", vol, vm)
	}
	return dev
}

func (h *harness) unplug(vm, vol string) {
	h.t.Helper()
	if err := h.disks.Unplug(testContext(h.t), vm, vol); err != nil {
		h.t.Fatal(err)
	}
}

// loopsOf lists the loop devices backed by vol's backing file.
func (h *harness) loopsOf(vol string) []string {
	out, err := exec.Command("losetup", "--noheadings", "--output", "NAME", "--associated", h.disks.BackingFile(vol)).Output()
	if err != nil {
		h.t.Fatalf("losetup: %v", err)
	}
	return strings.Fields(string(out))
}

// waitNoLoops waits until the kernel released every loop device of vol; it
// does so only once the last mount and open of it are gone, which can take a
// while on a busy machine.
func (h *harness) waitNoLoops(vol string) {
	h.t.Helper()
	h.waitNoLoopsBut(vol, 0)
}

// waitNoLoopsBut waits until exactly n loop devices are left on vol's file.
func (h *harness) waitNoLoopsBut(vol string, n int) {
	h.t.Helper()
	nodetest.Eventually(h.t, fmt.Sprintf("%d loop devices on %s", n, vol), func() bool { return len(h.loopsOf(vol)) == n })
}

func mountCap(fsType string, mode csi.VolumeCapability_AccessMode_Mode, flags ...string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType, MountFlags: flags}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

const rwo = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

func (n *node) stage(ctx context.Context, vol, staging string, c *csi.VolumeCapability) error {
	_, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol, StagingTargetPath: staging, VolumeCapability: c})
	return err
}

func (n *node) publish(ctx context.Context, vol, staging, target string, c *csi.VolumeCapability, ro bool) error {
	_, err := n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: vol, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c, Readonly: ro,
	})
	return err
}

func (n *node) unpublish(ctx context.Context, vol, target string) error {
	_, err := n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol, TargetPath: target})
	return err
}

func (n *node) unstage(ctx context.Context, vol, staging string) error {
	_, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol, StagingTargetPath: staging})
	return err
}

// mount stages vol at staging and publishes it read-write at target, as
// kubelet mounts a pod's volume.
func (n *node) mount(ctx context.Context, t *testing.T, vol, staging, target string, c *csi.VolumeCapability) {
	t.Helper()
	must(t, n.stage(ctx, vol, staging, c), "stage on "+n.vm)
	must(t, n.publish(ctx, vol, staging, target, c, false), "publish on "+n.vm)
}

// unmount undoes mount, as kubelet does once the pod is gone.
func (n *node) unmount(ctx context.Context, t *testing.T, vol, staging, target string) {
	t.Helper()
	must(t, n.unpublish(ctx, vol, target), "unpublish on "+n.vm)
	must(t, n.unstage(ctx, vol, staging), "unstage on "+n.vm)
}

func must(t *testing.T, err error, what string) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func wantCode(t *testing.T, err error, code codes.Code, what string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("%s: got %v, want code %s", what, err, code)
	}
}

func isMountPoint(t *testing.T, path string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}
