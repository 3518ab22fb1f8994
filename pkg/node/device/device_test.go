package device

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
)

func TestMain(m *testing.M) { nodetest.Main(m) }

// fixture makes block device nodes (not attached to anything) and by-id links
// to them; mknod needs root.
type fixture struct {
	t     *testing.T
	dev   string
	byID  string
	minor uint32
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create block device nodes with mknod")
	}
	root := t.TempDir()
	f := &fixture{t: t, dev: filepath.Join(root, "dev"), byID: filepath.Join(root, "by-id"), minor: 4000}
	for _, d := range []string{f.dev, f.byID} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// disk creates a device node and returns its path.
func (f *fixture) disk(name string) string {
	f.t.Helper()
	f.minor++
	p := filepath.Join(f.dev, name)
	if err := unix.Mknod(p, unix.S_IFBLK|0o600, int(unix.Mkdev(7, f.minor))); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func (f *fixture) link(name, target string) {
	f.t.Helper()
	if err := os.Symlink(target, filepath.Join(f.byID, name)); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fixture) finder() *Finder {
	return NewFinder(FinderOptions{ByIDDir: f.byID, SysfsRoot: filepath.Join(f.dev, "no-sysfs"), Wait: 300 * time.Millisecond, PollInterval: 20 * time.Millisecond})
}

func TestLookup(t *testing.T) {
	f := newFixture(t)
	sda, sdb, sdc := f.disk("sda"), f.disk("sdb"), f.disk("sdc")
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-1", sda)
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-1-part1", sdc) // a partition, never the disk
	f.link("wwn-0x5000-pvc-1-legacy", sda)                       // same disk, other name
	f.link("scsi-0QEMU_QEMU_HARDDISK_SERIAL42", sdb)
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-gone", filepath.Join(f.dev, "nothing")) // dangling
	f.link("virtio-pvc-2x", sdc)
	fi := f.finder()

	d, err := fi.Lookup("pvc-1", "")
	if err != nil || d.Path != sda || !strings.HasSuffix(d.Link, "drive-ua-pvc-1") {
		t.Fatalf("alias lookup: %+v %v", d, err)
	}
	// The serial wins over the name.
	if d, err := fi.Lookup("pvc-1", "SERIAL42"); err != nil || d.Path != sdb {
		t.Fatalf("serial lookup: %+v %v", d, err)
	}
	// Upstream's "name contains the volume ID".
	if d, err := fi.Lookup("pvc-2", ""); err != nil || d.Path != sdc {
		t.Fatalf("contains lookup: %+v %v", d, err)
	}
	_, err = fi.Lookup("pvc-gone", "")
	var nf *NotFoundError
	if !errors.As(err, &nf) || !errors.Is(err, ErrNotFound) {
		t.Fatalf("dangling link: %v", err)
	}
}

func TestLookupAmbiguous(t *testing.T) {
	f := newFixture(t)
	f.link("scsi-a-pvc-9", f.disk("sda"))
	f.link("scsi-b-pvc-9", f.disk("sdb"))
	var amb *AmbiguousError
	if _, err := f.finder().Lookup("pvc-9", ""); !errors.As(err, &amb) || len(amb.Matches) != 2 {
		t.Fatalf("got %v", err)
	}
}

func TestWait(t *testing.T) {
	f := newFixture(t)
	_, ctx := ktesting.NewTestContext(t)
	fi := f.finder()
	start := time.Now()
	_, err := fi.Wait(ctx, "pvc-late", "")
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "after waiting") || !strings.Contains(err.Error(), f.byID) {
		t.Fatalf("got %v", err)
	}
	if time.Since(start) < 300*time.Millisecond {
		t.Fatal("did not wait")
	}

	sdx := f.disk("sdx")
	go func() {
		time.Sleep(100 * time.Millisecond)
		f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-late", sdx)
	}()
	d, err := fi.Wait(ctx, "pvc-late", "")
	if err != nil || d.Path != sdx {
		t.Fatalf("got %+v %v", d, err)
	}

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := fi.Wait(cctx, "pvc-never", ""); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled wait: %v", err)
	}
}

func TestPresent(t *testing.T) {
	f := newFixture(t)
	sda := f.disk("sda")
	f.link("scsi-x-pvc-1", sda)
	fi := f.finder()
	d, err := fi.Lookup("pvc-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if ok, _, err := fi.Present(d); !ok || err != nil {
		t.Fatalf("present disk reported gone: %v", err)
	}
	if err := os.Remove(d.Link); err != nil {
		t.Fatal(err)
	}
	ok, reason, err := fi.Present(d)
	if ok || err != nil || !strings.Contains(reason, f.byID) {
		t.Fatalf("unlinked disk: %v %q %v", ok, reason, err)
	}
	// A missing by-id directory is a configuration problem, not a gone disk.
	missing := NewFinder(FinderOptions{ByIDDir: filepath.Join(f.dev, "nope"), SysfsRoot: filepath.Join(f.dev, "nope")})
	if ok, _, _ := missing.Present(d); !ok {
		t.Fatal("missing by-id dir counted as gone")
	}
	// With real sysfs, a device number nobody has is gone.
	real := NewFinder(FinderOptions{ByIDDir: f.byID})
	if ok, reason, _ := real.Present(Device{Major: 7, Minor: 1 << 19}); ok || !strings.Contains(reason, "no longer exists") {
		t.Fatalf("nonexistent device: %v %q", ok, reason)
	}
}

func loop(t *testing.T) (string, *loopdisk.LoopDisks) {
	t.Helper()
	nodetest.RequireRealDevices(t)
	root := t.TempDir()
	disks, err := loopdisk.New(loopdisk.Options{BackingDir: filepath.Join(root, "host"), ByIDRoot: filepath.Join(root, "by-id"),
		Size: func(context.Context, string) (int64, error) { return 8 << 20, nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = disks.Close(context.Background()) })
	if err := disks.Plug(context.Background(), "vm", "pvc-1", "pvc-1"); err != nil {
		t.Fatal(err)
	}
	dev, _ := disks.Device("vm", "pvc-1")
	return dev, disks
}

func TestInUse(t *testing.T) {
	dev, _ := loop(t)
	_, ctx := ktesting.NewTestContext(t)
	d, err := FromPath(dev)
	if err != nil {
		t.Fatal(err)
	}
	c := NewInUseChecker(InUseOptions{Rechecks: 2, RecheckInterval: 100 * time.Millisecond})
	if err := c.Check(ctx, d); err != nil {
		t.Fatalf("idle device: %v", err)
	}

	// Our own descriptor is never a holder (seed 003).
	own, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = own.Close() }()
	if hs, err := c.Scan(ctx, d); err != nil || len(hs) != 0 {
		t.Fatalf("own fd reported: %v %v", hs, err)
	}
	// Unless we pretend to be someone else.
	other := NewInUseChecker(InUseOptions{SelfPID: 1})
	if hs, _ := other.Scan(ctx, d); len(hs) == 0 || hs[0].PID != os.Getpid() {
		t.Fatalf("own fd not seen from another PID: %v", hs)
	}
	_ = own.Close()

	cmd := exec.Command("bash", "-c", `exec 3<"$1"; exec sleep 60`, "holder", dev)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		hs, _ := c.Scan(ctx, d)
		if len(hs) == 1 && hs[0].Command == "sleep" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("holder not found: %v", hs)
		}
		time.Sleep(10 * time.Millisecond)
	}
	err = c.Check(ctx, d)
	var iu *InUseError
	if !errors.As(err, &iu) || iu.Holders[0].PID != cmd.Process.Pid || !strings.Contains(err.Error(), "pid "+strconv.Itoa(cmd.Process.Pid)+" (sleep) fd 3") {
		t.Fatalf("got %v", err)
	}
}

func TestInUseByMountAndOpenFile(t *testing.T) {
	dev, _ := loop(t)
	_, ctx := ktesting.NewTestContext(t)
	d, _ := FromPath(dev)
	mnt := t.TempDir()
	nodetest.CleanupMounts(t, mnt)
	nodetest.Run(t, "mkfs.ext4", "-q", dev)
	nodetest.Run(t, "mount", dev, mnt)
	c := NewInUseChecker(InUseOptions{Rechecks: 1, RecheckInterval: 50 * time.Millisecond})
	if err := c.Check(ctx, d, mnt); err != nil {
		t.Fatalf("allowed mount reported: %v", err)
	}
	if err := c.Check(ctx, d); err == nil || !strings.Contains(err.Error(), "mounted at "+mnt) {
		t.Fatalf("mount not reported: %v", err)
	}
	// A process working inside the filesystem holds it too.
	cmd := exec.Command("sleep", "60")
	cmd.Dir = mnt
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if err := c.Check(ctx, d, mnt); err == nil || !strings.Contains(err.Error(), "(sleep) cwd") {
		t.Fatalf("cwd holder not reported: %v", err)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	nodetest.Run(t, "umount", mnt)
}
