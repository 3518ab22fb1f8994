package simhost

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
	return strings.TrimSpace(string(out))
}

// A filesystem still mounted on an unplugged disk (a staging mount whose
// NodeUnstageVolume never came) must not reach the disk any more: neither
// the writes it makes afterwards nor those it had not flushed. Without cutIO
// a plain loop device takes them all.
func TestCutIOStopsAStaleMountFromWriting(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (loop devices, mounts)")
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		t.Fatal(err)
	}
	dev := run(t, "losetup", "--find", "--show", img)
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", dev).Run() })
	run(t, "mkfs.ext4", "-q", dev)
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o750); err != nil {
		t.Fatal(err)
	}
	run(t, "mount", dev, mnt)
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	if err := os.WriteFile(filepath.Join(mnt, "before"), []byte("durable"), 0o600); err != nil {
		t.Fatal(err)
	}
	run(t, "sync", "-f", filepath.Join(mnt, "before"))
	before, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}

	if err := cutIO(dev); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(mnt, "after"))
	if err == nil {
		_, _ = f.Write(bytes.Repeat([]byte("x"), 1<<20))
		err = f.Sync()
		f.Close()
	}
	if err == nil {
		t.Fatal("writing and syncing on the unplugged disk succeeded")
	}
	run(t, "umount", "-l", mnt)
	after, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("the stale mount changed the disk after it was unplugged")
	}
}
