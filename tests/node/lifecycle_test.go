package node

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
)

// The whole life of a filesystem volume: stage, publish, write, unpublish,
// unstage, detach, attach to another VM, stage there and read the same bytes.
func TestFilesystemMovesBetweenNodes(t *testing.T) {
	for _, tc := range []struct {
		fsType string
		size   int64
		tools  []string
	}{
		{fsType: "", size: 128 * mib}, // ext4 by default
		{fsType: "xfs", size: 320 * mib, tools: []string{"mkfs.xfs", "xfs_growfs"}}, // xfs needs >= 300 MiB
	} {
		name := tc.fsType
		if name == "" {
			name = "default-ext4"
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, tc.size, tc.tools...)
			ctx := testContext(t)
			vol := "pvc-move-" + name
			c := mountCap(tc.fsType, rwo)

			a := h.node("vm-a", nil)
			h.plug("vm-a", vol)
			stagingA, targetA := a.paths(vol, "pod-1")
			must(t, a.stage(ctx, vol, stagingA, c), "stage on vm-a")
			must(t, a.stage(ctx, vol, stagingA, c), "stage again (idempotent)")
			must(t, a.publish(ctx, vol, stagingA, targetA, c, false), "publish on vm-a")
			must(t, a.publish(ctx, vol, stagingA, targetA, c, false), "publish again (idempotent)")
			wantFS := tc.fsType
			if wantFS == "" {
				wantFS = "ext4"
			}
			if got := strings.TrimSpace(nodetest.Run(t, "findmnt", "-n", "-o", "FSTYPE", stagingA)); got != wantFS {
				t.Fatalf("staging filesystem %q, want %q", got, wantFS)
			}
			nodetest.WriteRandom(t, filepath.Join(targetA, "data"), 3<<20, 7)
			sum := nodetest.Checksum(t, filepath.Join(targetA, "data"))

			stats, err := a.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vol, VolumePath: targetA})
			must(t, err, "stats")
			if u := stats.GetUsage()[0]; u.GetUnit() != csi.VolumeUsage_BYTES || u.GetUsed() < 3<<20 || u.GetTotal() < 64*mib {
				t.Fatalf("unexpected byte usage %v", u)
			}
			if in := stats.GetUsage()[1]; in.GetUnit() != csi.VolumeUsage_INODES || in.GetUsed() < 1 || in.GetTotal() <= in.GetUsed() {
				t.Fatalf("unexpected inode usage %v", in)
			}
			if stats.GetVolumeCondition().GetAbnormal() {
				t.Fatalf("condition abnormal: %v", stats.GetVolumeCondition())
			}

			must(t, a.unpublish(ctx, vol, targetA), "unpublish")
			if exists(targetA) {
				t.Fatalf("target %s not removed", targetA)
			}
			must(t, a.unpublish(ctx, vol, targetA), "unpublish again (idempotent)")
			must(t, a.unstage(ctx, vol, stagingA), "unstage")
			must(t, a.unstage(ctx, vol, stagingA), "unstage again (idempotent)")
			if isMountPoint(t, stagingA) {
				t.Fatal("staging path still mounted")
			}
			h.unplug("vm-a", vol)
			h.waitNoLoops(vol) // detached: no loop device left on the backing file

			b := h.node("vm-b", nil)
			h.plug("vm-b", vol)
			stagingB, targetB := b.paths(vol, "pod-2")
			b.mount(ctx, t, vol, stagingB, targetB, c)
			if got := nodetest.Checksum(t, filepath.Join(targetB, "data")); got != sum {
				t.Fatalf("data changed moving between nodes: %s != %s", got, sum)
			}
			b.unmount(ctx, t, vol, stagingB, targetB)
			h.unplug("vm-b", vol)
			h.waitNoLoops(vol)
		})
	}
}

// A formatted disk is never formatted again, not even when another
// filesystem type is asked for.
func TestExistingFilesystemIsNeverReformatted(t *testing.T) {
	h := newHarness(t, 320*mib, "mkfs.xfs")
	ctx := testContext(t)
	vol := "pvc-keep"
	a := h.node("vm-a", nil)
	h.plug("vm-a", vol)
	staging, target := a.paths(vol, "pod")
	a.mount(ctx, t, vol, staging, target, mountCap("ext4", rwo))
	nodetest.WriteRandom(t, filepath.Join(target, "keep"), 1<<20, 3)
	sum := nodetest.Checksum(t, filepath.Join(target, "keep"))
	a.unmount(ctx, t, vol, staging, target)

	err := a.stage(ctx, vol, staging, mountCap("xfs", rwo))
	wantCode(t, err, codes.FailedPrecondition, "stage as xfs over ext4")
	if !strings.Contains(err.Error(), "refusing to reformat") {
		t.Fatalf("unclear error: %v", err)
	}
	// No fsType: the existing filesystem is used as it is.
	a.mount(ctx, t, vol, staging, target, mountCap("", rwo))
	if got := nodetest.Checksum(t, filepath.Join(target, "keep")); got != sum {
		t.Fatal("data lost")
	}
	a.unmount(ctx, t, vol, staging, target)
}

// Mount flags reach the staging mount and the per-mount ones the bind.
func TestMountFlags(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	vol := "pvc-flags"
	a := h.node("vm-a", nil)
	h.plug("vm-a", vol)
	staging, target := a.paths(vol, "pod")
	c := mountCap("ext4", rwo, "noatime", "nosuid", "discard")
	a.mount(ctx, t, vol, staging, target, c)
	for path, want := range map[string][]string{staging: {"noatime", "nosuid", "discard"}, target: {"noatime", "nosuid"}} {
		got := nodetest.Run(t, "findmnt", "-n", "-o", "OPTIONS", path)
		for _, w := range want {
			if !strings.Contains(got, w) {
				t.Errorf("%s options %q lack %s", path, strings.TrimSpace(got), w)
			}
		}
	}
	a.unmount(ctx, t, vol, staging, target)
}

// Raw block: the device bound onto a file; bytes written there are read back
// on another node.
func TestBlockMovesBetweenNodes(t *testing.T) {
	h := newHarness(t, 32*mib)
	ctx := testContext(t)
	vol := "pvc-block"
	c := blockCap()
	a := h.node("vm-a", nil)
	h.plug("vm-a", vol)
	stagingA, targetA := a.paths(vol, "pod-1")
	a.mount(ctx, t, vol, stagingA, targetA, c)
	must(t, a.publish(ctx, vol, stagingA, targetA, c, false), "publish again (idempotent)")
	var st unix.Stat_t
	must(t, unix.Stat(targetA, &st), "stat target")
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Fatalf("target is not a block device (mode %o)", st.Mode)
	}
	payload := bytes.Repeat([]byte("harvester-block-"), 1<<16) // 1 MiB
	f, err := os.OpenFile(targetA, os.O_RDWR, 0)
	must(t, err, "open target")
	_, err = f.WriteAt(payload, 4096)
	must(t, err, "write")
	must(t, f.Sync(), "sync")
	must(t, f.Close(), "close")

	stats, err := a.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vol, VolumePath: targetA})
	must(t, err, "stats")
	if got := stats.GetUsage()[0].GetTotal(); got != 32*mib {
		t.Fatalf("block size %d, want %d", got, 32*mib)
	}
	if stats.GetVolumeCondition().GetAbnormal() {
		t.Fatalf("condition abnormal: %v", stats.GetVolumeCondition())
	}

	must(t, a.unpublish(ctx, vol, targetA), "unpublish")
	if exists(targetA) {
		t.Fatal("block target file not removed")
	}
	must(t, a.unstage(ctx, vol, stagingA), "unstage")
	h.unplug("vm-a", vol)
	h.waitNoLoops(vol)

	b := h.node("vm-b", nil)
	h.plug("vm-b", vol)
	stagingB, targetB := b.paths(vol, "pod-2")
	b.mount(ctx, t, vol, stagingB, targetB, c)
	got := make([]byte, len(payload))
	f, err = os.Open(targetB)
	must(t, err, "open on vm-b")
	_, err = f.ReadAt(got, 4096)
	_ = f.Close()
	must(t, err, "read")
	if !bytes.Equal(got, payload) {
		t.Fatal("block data differs on the other node")
	}
	b.unmount(ctx, t, vol, stagingB, targetB)
	h.unplug("vm-b", vol)
	h.waitNoLoops(vol)
}

// A read-only publish cannot be written through, while another publish of
// the same staged volume stays writable.
func TestReadOnlyPublish(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	vol := "pvc-ro"
	c := mountCap("ext4", rwo)
	a := h.node("vm-a", nil)
	h.plug("vm-a", vol)
	staging, rwTarget := a.paths(vol, "pod-rw")
	_, roTarget := a.paths(vol, "pod-ro")
	a.mount(ctx, t, vol, staging, rwTarget, c)
	must(t, a.publish(ctx, vol, staging, roTarget, c, true), "publish ro")
	must(t, a.publish(ctx, vol, staging, roTarget, c, true), "publish ro again (idempotent)")
	wantCode(t, a.publish(ctx, vol, staging, roTarget, c, false), codes.AlreadyExists, "publish rw over ro target")

	must(t, os.WriteFile(filepath.Join(rwTarget, "f"), []byte("x"), 0o600), "write through rw target")
	err := os.WriteFile(filepath.Join(roTarget, "g"), []byte("x"), 0o600)
	if !errors.Is(err, unix.EROFS) {
		t.Fatalf("write through read-only target: got %v, want EROFS", err)
	}
	if b, err := os.ReadFile(filepath.Join(roTarget, "f")); err != nil || string(b) != "x" {
		t.Fatalf("read through read-only target: %q %v", b, err)
	}
	for _, tgt := range []string{rwTarget, roTarget} {
		must(t, a.unpublish(ctx, vol, tgt), "unpublish "+tgt)
	}
	must(t, a.unstage(ctx, vol, staging), "unstage")
}

// Online expansion: the disk grows (backing file and loop capacity), then
// NodeExpandVolume grows the mounted filesystem.
func TestExpandGrowsFilesystem(t *testing.T) {
	for _, tc := range []struct {
		fsType   string
		from, to int64
		tools    []string
	}{
		{fsType: "ext4", from: 64 * mib, to: 256 * mib},
		{fsType: "xfs", from: 320 * mib, to: 640 * mib, tools: []string{"mkfs.xfs", "xfs_growfs"}},
	} {
		t.Run(tc.fsType, func(t *testing.T) {
			if tc.fsType == "ext4" && !nodetest.HasCapability(nodetest.CapSysResource) {
				t.Skip("growing a mounted ext4 needs CAP_SYS_RESOURCE, which this sandbox drops (the DaemonSet is privileged)")
			}
			h := newHarness(t, tc.from, tc.tools...)
			ctx := testContext(t)
			vol := "pvc-grow-" + tc.fsType
			c := mountCap(tc.fsType, rwo)
			a := h.node("vm-a", nil)
			h.plug("vm-a", vol)
			staging, target := a.paths(vol, "pod")
			a.mount(ctx, t, vol, staging, target, c)
			nodetest.WriteRandom(t, filepath.Join(target, "data"), 1<<20, 9)
			sum := nodetest.Checksum(t, filepath.Join(target, "data"))
			before := totalBytes(t, a, vol, target)

			// Asking for more than the disk has is refused until it grows.
			_, err := a.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol, VolumePath: target,
				CapacityRange: &csi.CapacityRange{RequiredBytes: tc.to}})
			wantCode(t, err, codes.FailedPrecondition, "expand before the disk grew")

			must(t, h.disks.Grow(ctx, vol, tc.to), "grow disk")
			resp, err := a.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol, VolumePath: target,
				StagingTargetPath: staging, VolumeCapability: c, CapacityRange: &csi.CapacityRange{RequiredBytes: tc.to}})
			must(t, err, "expand")
			if resp.GetCapacityBytes() < tc.to {
				t.Fatalf("capacity %d < %d", resp.GetCapacityBytes(), tc.to)
			}
			after := totalBytes(t, a, vol, target)
			if after < before+(tc.to-tc.from)*8/10 {
				t.Fatalf("filesystem did not grow enough: %d -> %d bytes", before, after)
			}
			if got := nodetest.Checksum(t, filepath.Join(target, "data")); got != sum {
				t.Fatal("data changed by expansion")
			}
			a.unmount(ctx, t, vol, staging, target)
		})
	}
}

func totalBytes(t *testing.T, n *node, vol, path string) int64 {
	t.Helper()
	st, err := n.NodeGetVolumeStats(testContext(t), &csi.NodeGetVolumeStatsRequest{VolumeId: vol, VolumePath: path})
	must(t, err, "stats")
	return st.GetUsage()[0].GetTotal()
}

// Block volumes report their new size after the disk grew.
func TestExpandBlock(t *testing.T) {
	h := newHarness(t, 16*mib)
	ctx := testContext(t)
	vol := "pvc-grow-block"
	a := h.node("vm-a", nil)
	h.plug("vm-a", vol)
	staging, target := a.paths(vol, "pod")
	a.mount(ctx, t, vol, staging, target, blockCap())
	must(t, h.disks.Grow(ctx, vol, 48*mib), "grow disk")
	resp, err := a.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol, VolumePath: target, VolumeCapability: blockCap()})
	must(t, err, "expand")
	if resp.GetCapacityBytes() != 48*mib {
		t.Fatalf("capacity %d, want %d", resp.GetCapacityBytes(), 48*mib)
	}
	a.unmount(ctx, t, vol, staging, target)
}

// holdDevice starts `sleep` with dev open as fd 3 (via bash's exec 3<) and
// returns it once the fd is really open.
func holdDevice(t *testing.T, dev, seconds string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("bash", "-c", `exec 3<"$1"; exec sleep "$2"`, "holder", dev, seconds)
	must(t, cmd.Start(), "start holder")
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	fd := filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "fd", "3")
	nodetest.Eventually(t, "the holder to open "+dev, func() bool {
		comm, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "comm"))
		l, err := os.Readlink(fd)
		return err == nil && l == dev && strings.TrimSpace(string(comm)) == "sleep"
	})
	return cmd
}

// A real process holding the disk blocks NodeUnstage, naming its PID; the
// driver's own open and a short-lived open by another process do not.
func TestUnstageRefusesWhileDeviceInUse(t *testing.T) {
	for _, c := range []*csi.VolumeCapability{mountCap("ext4", rwo), blockCap()} {
		kind := "filesystem"
		if c.GetBlock() != nil {
			kind = "block"
		}
		t.Run(kind, func(t *testing.T) {
			h := newHarness(t, 64*mib)
			ctx := testContext(t)
			vol := "pvc-busy-" + kind
			// A holder that stays is refused after five re-checks.
			a := h.node("vm-a", func(o *driver.NodeOptions) { o.InUseRechecks = 5 })
			dev := h.plug("vm-a", vol)
			staging, _ := a.paths(vol, "pod")
			must(t, a.stage(ctx, vol, staging, c), "stage")

			holder := holdDevice(t, dev, "300")
			err := a.unstage(ctx, vol, staging)
			wantCode(t, err, codes.FailedPrecondition, "unstage while held")
			pid := strconv.Itoa(holder.Process.Pid)
			if !strings.Contains(err.Error(), "pid "+pid) || !strings.Contains(err.Error(), "sleep") {
				t.Fatalf("error does not name pid %s and its command: %v", pid, err)
			}
			if kind == "filesystem" && !isMountPoint(t, staging) {
				t.Fatal("refused unstage still unmounted the staging path")
			}
			_ = holder.Process.Kill()
			_ = holder.Wait()

			// Our own open is ignored: the driver itself opens the device briefly.
			own, err := os.Open(dev)
			must(t, err, "open device ourselves")
			defer func() { _ = own.Close() }()

			// Another process that lets go while the re-checks last is
			// transient. It is let go only once the driver has seen it and
			// is checking again, so the re-check is what lets the unstage
			// through, whatever the machine's timing.
			patient := h.node("vm-a", func(o *driver.NodeOptions) { o.InUseRechecks = 1200; o.InUseRecheckInterval = 100 * time.Millisecond })
			transient := holdDevice(t, dev, "300")
			logs := &logLines{}
			done := make(chan error, 1)
			go func() { done <- patient.unstage(klog.NewContext(ctx, logs.logger()), vol, staging) }()
			testwait.Until(ctx, t, "the driver to see the transient holder and check again", func() (bool, string) {
				select {
				case err := <-done:
					t.Fatalf("the unstage answered %v without waiting for the holder to go: %q", err, logs.all())
				default:
				}
				return logs.has("device looks busy, checking again"), strings.Join(logs.all(), "\n")
			})
			_ = transient.Process.Kill()
			_ = transient.Wait()
			must(t, <-done, "unstage with only our own and a transient open")
			if !logs.has("device holders were transient") {
				t.Fatalf("the unstage went through without finding the holder gone on a re-check: %q", logs.all())
			}
			if isMountPoint(t, staging) {
				t.Fatal("staging path still mounted")
			}
			_ = own.Close()
			h.unplug("vm-a", vol)
			h.waitNoLoops(vol)
		})
	}
}

// logLines records what the driver logs through the context's logger, up to
// verbosity 2, where the in-use checker says what it saw.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.lines = append(l.lines, args)
	}, funcr.Options{Verbosity: 2})
}

func (l *logLines) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.lines)
}

func (l *logLines) has(msg string) bool {
	return slices.ContainsFunc(l.all(), func(line string) bool { return strings.Contains(line, `"msg"="`+msg+`"`) })
}

// A pod's mount of the volume still in place also blocks NodeUnstage.
func TestUnstageRefusesWhilePublished(t *testing.T) {
	h := newHarness(t, 64*mib)
	ctx := testContext(t)
	vol := "pvc-published"
	c := mountCap("ext4", rwo)
	a := h.node("vm-a", nil)
	h.plug("vm-a", vol)
	staging, target := a.paths(vol, "pod")
	a.mount(ctx, t, vol, staging, target, c)
	err := a.unstage(ctx, vol, staging)
	wantCode(t, err, codes.FailedPrecondition, "unstage while published")
	if !strings.Contains(err.Error(), target) {
		t.Fatalf("error does not name the publish mount %s: %v", target, err)
	}
	a.unmount(ctx, t, vol, staging, target)
}

// harvester/harvester#11716 on the node: the disk of a 1G claim is the host's
// 1000341504 bytes (954Mi, Longhorn's 2 MiB steps). Node expansion to any
// size up to that is done (the filesystem already fills the disk), answered
// with the disk's size; nothing says shrink or "not grown yet".
func TestNodeExpandInsideTheHostRounding(t *testing.T) {
	const hostPVC = int64(1_000_341_504)
	for _, block := range []bool{false, true} {
		name := map[bool]string{false: "ext4", true: "block"}[block]
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, hostPVC)
			ctx := testContext(t)
			vol := "pvc-repro-" + name
			c := mountCap("ext4", rwo)
			if block {
				c = blockCap()
			}
			a := h.node("vm-a", nil)
			h.plug("vm-a", vol)
			staging, target := a.paths(vol, "pod")
			a.mount(ctx, t, vol, staging, target, c)
			for _, required := range []int64{1_000_000_001, 1_000_300_000, hostPVC} {
				resp, err := a.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol, VolumePath: target,
					StagingTargetPath: staging, VolumeCapability: c, CapacityRange: &csi.CapacityRange{RequiredBytes: required}})
				must(t, err, fmt.Sprintf("node expansion to %d bytes, inside the host's rounding", required))
				if resp.GetCapacityBytes() != hostPVC {
					t.Errorf("node expansion to %d answered %d bytes, want the disk's %d", required, resp.GetCapacityBytes(), hostPVC)
				}
			}
			a.unmount(ctx, t, vol, staging, target)
		})
	}
}
