package mounter

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
)

func TestMain(m *testing.M) { nodetest.Main(m) }

func setup(t *testing.T, size int64) (context.Context, *Mounter, string, string) {
	t.Helper()
	nodetest.RequireRealDevices(t)
	root := t.TempDir()
	disks, err := loopdisk.New(loopdisk.Options{BackingDir: filepath.Join(root, "host"), ByIDRoot: filepath.Join(root, "by-id"),
		Size: func(context.Context, string) (int64, error) { return size, nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = disks.Close(context.Background()) })
	nodetest.CleanupMounts(t, root)
	if err := disks.Plug(context.Background(), "vm", "pvc", "pvc"); err != nil {
		t.Fatal(err)
	}
	dev, _ := disks.Device("vm", "pvc")
	_, ctx := ktesting.NewTestContext(t)
	return ctx, New(Options{}), dev, root
}

func TestFormatOnlyBlankDisks(t *testing.T) {
	ctx, m, dev, root := setup(t, 32<<20)
	if f, err := m.DiskFormat(ctx, dev); err != nil || f != "" {
		t.Fatalf("blank disk: %q %v", f, err)
	}
	mnt := filepath.Join(root, "mnt")
	if _, err := m.FormatAndMount(ctx, dev, mnt, "", []string{"ro"}); err == nil {
		t.Fatal("formatted a disk for a read-only mount")
	}
	formatted, err := m.FormatAndMount(ctx, dev, mnt, "", nil)
	if err != nil || !formatted {
		t.Fatalf("first mount: %v %v", formatted, err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "f"), []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmount(ctx, mnt); err != nil {
		t.Fatal(err)
	}
	var mis *MismatchError
	if _, err := m.FormatAndMount(ctx, dev, mnt, "xfs", nil); !errors.As(err, &mis) || mis.Have != "ext4" {
		t.Fatalf("fs type mismatch: %v", err)
	}
	formatted, err = m.FormatAndMount(ctx, dev, mnt, "ext4", nil)
	if err != nil || formatted {
		t.Fatalf("second mount: %v %v", formatted, err)
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "f")); err != nil || string(b) != "keep" {
		t.Fatalf("data: %q %v", b, err)
	}
	if err := m.Unmount(ctx, mnt); err != nil {
		t.Fatal(err)
	}
}

func TestPartitionedDiskIsLeftAlone(t *testing.T) {
	ctx, m, dev, root := setup(t, 32<<20)
	// An MBR with one Linux partition at 1 MiB, written by hand so the
	// test needs no partitioning tool.
	mbr := make([]byte, 512)
	entry := mbr[446:462]
	entry[4] = 0x83
	binary.LittleEndian.PutUint32(entry[8:], 2048)
	binary.LittleEndian.PutUint32(entry[12:], 4096)
	mbr[510], mbr[511] = 0x55, 0xaa
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(mbr, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := m.DiskFormat(ctx, dev)
	if err != nil || !strings.HasPrefix(got, "partition table") {
		t.Fatalf("got %q %v", got, err)
	}
	if _, err := m.FormatAndMount(ctx, dev, filepath.Join(root, "mnt"), "", nil); err == nil {
		t.Fatal("mounted/formatted a partitioned disk")
	}
}

func TestUnmountStackedAndRemovePath(t *testing.T) {
	ctx, m, _, root := setup(t, 8<<20)
	src := filepath.Join(root, "src")
	dst := filepath.Join(root, "dst")
	for _, d := range []string{src, dst} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(src, "f"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if err := m.BindMount(ctx, src, dst, i == 2, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.RemovePath(dst); err == nil {
		t.Fatal("removed a mount point")
	}
	if err := m.Unmount(ctx, dst); err != nil {
		t.Fatal(err)
	}
	if ok, _ := m.IsMountPoint(dst); ok {
		t.Fatal("still mounted")
	}
	if err := m.RemovePath(src); err == nil {
		t.Fatal("removed a non-empty directory")
	}
	if err := m.RemovePath(dst); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmount(ctx, dst); err != nil {
		t.Fatalf("unmount of a missing path: %v", err)
	}
}

func TestDeviceSizeAndStats(t *testing.T) {
	ctx, m, dev, root := setup(t, 48<<20)
	if n, err := DeviceSize(dev); err != nil || n != 48<<20 {
		t.Fatalf("size %d %v", n, err)
	}
	mnt := filepath.Join(root, "mnt")
	if _, err := m.FormatAndMount(ctx, dev, mnt, "ext4", nil); err != nil {
		t.Fatal(err)
	}
	st, err := FSStats(mnt)
	if err != nil || st.TotalBytes < 30<<20 || st.TotalBytes > 48<<20 || st.TotalInodes == 0 || st.UsedInodes < 1 {
		t.Fatalf("stats %+v %v", st, err)
	}
	if err := m.Unmount(ctx, mnt); err != nil {
		t.Fatal(err)
	}
}

// A symlink at a mount target, bind source or unmount path is
// never followed; what it points at is left exactly as it was.
func TestSymlinksAreNeverFollowed(t *testing.T) {
	ctx, m, dev, root := setup(t, 32<<20)
	outside := filepath.Join(root, "outside")
	mustMkdir(t, outside)
	if err := os.WriteFile(filepath.Join(outside, "keep"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(root, "link")
	if err := os.Symlink(outside, link); err != nil {
		t.Fatal(err)
	}
	var se *SymlinkError
	if _, err := m.FormatAndMount(ctx, dev, link, "ext4", nil); !errors.As(err, &se) {
		t.Fatalf("mount onto a symlink: %v", err)
	}
	if f, err := m.DiskFormat(ctx, dev); err != nil || f != "" {
		t.Fatalf("a refused mount formatted the disk: %q %v", f, err)
	}
	src := filepath.Join(root, "src")
	mustMkdir(t, src)
	if err := m.BindMount(ctx, src, link, false, nil); !errors.As(err, &se) {
		t.Fatalf("bind onto a symlink: %v", err)
	}
	dst := filepath.Join(root, "dst")
	mustMkdir(t, dst)
	if err := m.BindMount(ctx, link, dst, false, nil); !errors.As(err, &se) {
		t.Fatalf("bind from a symlink: %v", err)
	}
	if ok, _ := m.IsMountPoint(outside); ok {
		t.Fatal("the symlink's destination got mounted")
	}
	fileLink := filepath.Join(root, "file-link")
	if err := os.Symlink(filepath.Join(outside, "keep"), fileLink); err != nil {
		t.Fatal(err)
	}
	if err := EnsureFile(fileLink); !errors.As(err, &se) {
		t.Fatalf("EnsureFile through a symlink: %v", err)
	}
	if _, err := FSStats(link); !errors.As(err, &se) {
		t.Fatalf("FSStats through a symlink: %v", err)
	}

	// An unrelated mount behind a symlink survives Unmount of the link.
	if _, err := m.FormatAndMount(ctx, dev, outside, "ext4", nil); err != nil {
		t.Fatal(err)
	}
	if ok, err := m.IsMountPoint(link); err != nil || ok {
		t.Fatalf("a symlink to a mount counted as a mount point: %v %v", ok, err)
	}
	if err := m.Unmount(ctx, link); err != nil {
		t.Fatal(err)
	}
	if err := m.LazyUnmount(ctx, link); err != nil {
		t.Fatal(err)
	}
	if ok, _ := m.IsMountPoint(outside); !ok {
		t.Fatal("unmounting a symlink unmounted its destination")
	}
	if err := m.Unmount(ctx, outside); err != nil {
		t.Fatal(err)
	}
}

func mustMkdir(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
}
