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
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-1-part1", sdc)                          // a partition, never the disk
	f.link("wwn-0x5000-pvc-1-legacy", sda)                                                // same disk, other name
	f.link("scsi-0QEMU_QEMU_HARDDISK_pvc-2", sdb)                                         // scsi disk whose serial is the volume
	f.link("virtio-pvc-3", sdc)                                                           // virtio disk whose serial is the volume
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-gone", filepath.Join(f.dev, "nothing")) // dangling
	fi := f.finder()

	for vol, want := range map[string]string{"pvc-1": sda, "pvc-2": sdb, "pvc-3": sdc} {
		if d, err := fi.Lookup(vol); err != nil || d.Path != want {
			t.Errorf("lookup %s: %+v %v, want %s", vol, d, err, want)
		}
	}
	if d, _ := fi.Lookup("pvc-1"); !strings.HasSuffix(d.Link, "drive-ua-pvc-1") {
		t.Errorf("found through %s", d.Link)
	}
	_, err := fi.Lookup("pvc-gone")
	var nf *NotFoundError
	if !errors.As(err, &nf) || !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "drive-ua-pvc-gone") {
		t.Fatalf("dangling link: %v", err)
	}
}

// Only whole names count. "pvc-node" is a prefix of the
// plugged "pvc-node1" and "0000" a substring of "00000"; neither may find
// that disk, whatever the bus or serial form of the link.
func TestLookupMatchesWholeNamesOnly(t *testing.T) {
	f := newFixture(t)
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-node1", f.disk("sda"))
	f.link("scsi-0QEMU_QEMU_HARDDISK_00000", f.disk("sdb"))
	f.link("virtio-xpvc-v", f.disk("vda"))
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-a-b", f.disk("sdc"))
	fi := f.finder()
	for _, vol := range []string{"pvc-node", "node1", "0000", "000", "pvc-v", "a", "b", "ua-a-b"} {
		if d, err := fi.Lookup(vol); !errors.Is(err, ErrNotFound) {
			t.Errorf("lookup %q found %+v (%v), want not found", vol, d, err)
		}
	}
	if _, err := fi.Lookup("pvc-node1"); err != nil {
		t.Errorf("the exact name is still found: %v", err)
	}
}

// Two names of one volume pointing at different disks is an error naming
// both; the same disk under two names is not.
func TestLookupAmbiguous(t *testing.T) {
	f := newFixture(t)
	sda, sdb := f.disk("sda"), f.disk("sdb")
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-9", sda)
	f.link("virtio-pvc-9", sdb)
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-8", sda)
	f.link("scsi-0QEMU_QEMU_HARDDISK_pvc-8", sda)
	var amb *AmbiguousError
	_, err := f.finder().Lookup("pvc-9")
	if !errors.As(err, &amb) || len(amb.Matches) != 2 || !strings.Contains(err.Error(), sda) || !strings.Contains(err.Error(), sdb) {
		t.Fatalf("got %v", err)
	}
	if d, err := f.finder().Lookup("pvc-8"); err != nil || d.Path != sda {
		t.Fatalf("one disk under two names: %+v %v", d, err)
	}
}

// virtio reports 20 bytes of serial: "pvc-0a1b2c3d-4e5f-67" is all two
// volumes with those first 20 characters get. Such a link is never taken for
// either of them; the exact scsi name still is.
func TestLookupRefusesTruncatedVirtioSerial(t *testing.T) {
	f := newFixture(t)
	a, b := "pvc-0a1b2c3d-4e5f-6789-aaaa-000000000001", "pvc-0a1b2c3d-4e5f-6789-bbbb-000000000002"
	vda := f.disk("vda")
	f.link("virtio-"+a[:20], vda)
	fi := f.finder()
	for _, vol := range []string{a, b} {
		_, err := fi.Lookup(vol)
		var amb *AmbiguousError
		if !errors.As(err, &amb) || !amb.Truncated || !strings.Contains(err.Error(), "virtio-"+a[:20]) {
			t.Fatalf("lookup %s: %v", vol, err)
		}
	}
	// Waiting does not turn the truncated match into an answer.
	_, ctx := ktesting.NewTestContext(t)
	var amb *AmbiguousError
	if _, err := fi.Wait(ctx, a); !errors.As(err, &amb) {
		t.Fatalf("wait: %v", err)
	}
	sdb := f.disk("sdb")
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-"+b, sdb)
	if d, err := fi.Lookup(b); err != nil || d.Path != sdb {
		t.Fatalf("exact name next to a truncated one: %+v %v", d, err)
	}
}

// The disk link of volume "pvc-x-part1" is also the name udev gives the
// first partition of volume "pvc-x": a link to a partition is refused.
func TestLookupRefusesPartitionLink(t *testing.T) {
	f := newFixture(t)
	sys := filepath.Join(f.dev, "sys")
	sda1 := f.disk("sda1")
	partDir := filepath.Join(sys, "dev", "block", "7:"+strconv.Itoa(int(f.minor)))
	if err := os.MkdirAll(partDir, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(partDir, "partition"), []byte("1\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-x-part1", sda1)
	fi := NewFinder(FinderOptions{ByIDDir: f.byID, SysfsRoot: sys})
	var amb *AmbiguousError
	if _, err := fi.Lookup("pvc-x-part1"); !errors.As(err, &amb) || !strings.Contains(err.Error(), "partition") {
		t.Fatalf("got %v", err)
	}
}

// A volume ID that cannot be a KubeVirt disk name never has a link, and
// must not be turned into a path outside the by-id directory.
func TestLookupRejectsImpossibleIDs(t *testing.T) {
	f := newFixture(t)
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-x", f.disk("sda"))
	fi := f.finder()
	_, ctx := ktesting.NewTestContext(t)
	for _, vol := range []string{"../x", "x/../../x", "X", "a.b", strings.Repeat("a", 64)} {
		_, err := fi.Wait(ctx, vol)
		var nf *NotFoundError
		if !errors.As(err, &nf) || nf.Reason == "" {
			t.Errorf("%q: %v", vol, err)
		} else if nf.Waited != 0 {
			t.Errorf("%q: waited %s for a disk that can never come", vol, nf.Waited)
		}
	}
}

func TestWait(t *testing.T) {
	f := newFixture(t)
	_, ctx := ktesting.NewTestContext(t)
	fi := f.finder()
	start := time.Now()
	_, err := fi.Wait(ctx, "pvc-late")
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "after waiting") || !strings.Contains(err.Error(), f.byID) {
		t.Fatalf("got %v", err)
	}
	if time.Since(start) < 300*time.Millisecond {
		t.Fatal("did not wait")
	}

	// A disk that appears during the wait is found; the wait is long so the
	// link surely comes inside it however busy the machine is.
	sdx := f.disk("sdx")
	go func() {
		time.Sleep(100 * time.Millisecond)
		f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-late", sdx)
	}()
	patient := NewFinder(FinderOptions{ByIDDir: f.byID, SysfsRoot: filepath.Join(f.dev, "no-sysfs"), Wait: 2 * time.Minute, PollInterval: 20 * time.Millisecond})
	d, err := patient.Wait(ctx, "pvc-late")
	if err != nil || d.Path != sdx {
		t.Fatalf("got %+v %v", d, err)
	}

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := fi.Wait(cctx, "pvc-never"); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled wait: %v", err)
	}

	// The caller's deadline ends the wait as the bound does: the disk may
	// still come.
	dctx, dcancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer dcancel()
	_, err = patient.Wait(dctx, "pvc-never")
	var nf *NotFoundError
	if !errors.As(err, &nf) || !nf.StillArriving() || !strings.Contains(err.Error(), "pvc-never") {
		t.Fatalf("wait ended by the caller's deadline: %v", err)
	}
	if _, err := fi.Wait(ctx, "X"); !errors.As(err, &nf) || nf.StillArriving() {
		t.Fatalf("an ID that can never have a disk is not still arriving: %v", err)
	}
}

func TestPresent(t *testing.T) {
	f := newFixture(t)
	sda := f.disk("sda")
	f.link("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-1", sda)
	fi := f.finder()
	d, err := fi.Lookup("pvc-1")
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

	// Our own descriptor is never a holder: the driver opens the device itself.
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

	cmd := exec.Command("bash", "-c", `exec 3<"$1"; exec sleep 600`, "holder", dev)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	nodetest.Eventually(t, "the holder to show up", func() bool {
		hs, _ := c.Scan(ctx, d)
		return len(hs) == 1 && hs[0].Command == "sleep"
	})
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
