package loopdisk

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
)

func TestMain(m *testing.M) { nodetest.Main(m) }

func TestPlugUnplugGrow(t *testing.T) {
	nodetest.RequireRealDevices(t)
	_, ctx := ktesting.NewTestContext(t)
	root := t.TempDir()
	l, err := New(Options{BackingDir: filepath.Join(root, "host"), ByIDRoot: filepath.Join(root, "by-id")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close(context.Background()) })

	if err := l.Plug(ctx, "vm-a", "vol", "claim"); err != nil {
		t.Fatal(err)
	}
	dev, ok := l.Device("vm-a", "vol")
	if !ok || !strings.HasPrefix(dev, "/dev/loop") {
		t.Fatalf("device %q %v", dev, ok)
	}
	if err := l.Plug(ctx, "vm-a", "vol", "claim"); err != nil {
		t.Fatal(err)
	}
	if again, _ := l.Device("vm-a", "vol"); again != dev {
		t.Fatalf("second plug attached another device: %s", again)
	}
	link, err := os.Readlink(filepath.Join(l.ByIDDir("vm-a"), LinkName("vol")))
	if err != nil || link != dev {
		t.Fatalf("link %q %v", link, err)
	}
	st, err := os.Stat(l.BackingFile("claim"))
	if err != nil || st.Size() != DefaultSize {
		t.Fatalf("backing file %v %v", st, err)
	}
	if err := l.Grow(ctx, "claim", 2*DefaultSize); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "size")); err != nil || strings.TrimSpace(string(b)) != "4194304" {
		t.Fatalf("loop size after grow: %q %v", b, err)
	}
	if err := l.Unplug(ctx, "vm-a", "vol"); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.Device("vm-a", "vol"); ok {
		t.Fatal("still plugged")
	}
	if err := l.Unplug(ctx, "vm-a", "vol"); err != nil {
		t.Fatalf("second unplug: %v", err)
	}
	// The backing file, with its size, survives for the next attachment.
	if st, err := os.Stat(l.BackingFile("claim")); err != nil || st.Size() != 2*DefaultSize {
		t.Fatalf("backing file after unplug %v %v", st, err)
	}
	// The simulator names VMs "namespace/name".
	if err := l.Plug(ctx, "ns/vm-b", "vol", "claim"); err != nil {
		t.Fatal(err)
	}
	if err := l.Plug(ctx, "vm-c", "vol2", "claim2"); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for _, p := range [][2]string{{"ns/vm-b", "vol"}, {"vm-c", "vol2"}} {
		if _, ok := l.Device(p[0], p[1]); ok {
			t.Fatalf("Close left %v plugged", p)
		}
	}
}

// pattern is n pseudo-random bytes from seed.
func pattern(n int, seed uint32) []byte {
	buf := make([]byte, n)
	x := seed | 1
	for i := range buf {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		buf[i] = byte(x)
	}
	return buf
}

// writeDevice writes data at off on a block device, as a guest would, and
// flushes it.
func writeDevice(t *testing.T, dev string, off int64, data []byte) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	if _, err := f.WriteAt(data, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// sumDevice is the SHA-256 of n bytes at off on a block device.
func sumDevice(t *testing.T, dev string, off int64, n int) string {
	t.Helper()
	f, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	buf := make([]byte, n)
	if _, err := f.ReadAt(buf, off); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(buf)
	return hex.EncodeToString(sum[:])
}

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func deviceSize(t *testing.T, dev string) int64 {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "size"))
	if err != nil {
		t.Fatal(err)
	}
	sectors, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return sectors * 512
}

func plugged(ctx context.Context, t *testing.T, l *LoopDisks, vm, claim string) string {
	t.Helper()
	if err := l.Plug(ctx, vm, claim, claim); err != nil {
		t.Fatal(err)
	}
	dev, ok := l.Device(vm, claim)
	if !ok {
		t.Fatalf("%s not plugged into %s", claim, vm)
	}
	return dev
}

// TestSnapshotRestore: what a guest wrote and flushed to a plugged disk before
// Snapshot reads back from a claim Restored from it, not what it wrote after;
// snapshots are sparse, a never-plugged claim snapshots as zeros, a larger
// claim grows, and DeleteSnapshot and Close remove snapshot files.
func TestSnapshotRestore(t *testing.T) {
	nodetest.RequireRealDevices(t)
	_, ctx := ktesting.NewTestContext(t)
	root := t.TempDir()
	l, err := New(Options{
		BackingDir: filepath.Join(root, "host"), ByIDRoot: filepath.Join(root, "by-id"),
		Size: func(_ context.Context, claim string) (int64, error) {
			if claim == "big" {
				return 2 * DefaultSize, nil
			}
			return DefaultSize, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close(context.Background()) })

	const far = 600 << 20 // a second extent, past a long hole
	head, tail := pattern(1<<20, 1), pattern(3<<20+4096, 2)
	src := plugged(ctx, t, l, "ns/vm-a", "src")
	writeDevice(t, src, 0, head)
	writeDevice(t, src, far, tail)
	const snap = "guests/snap-1"
	if err := l.Snapshot(ctx, "src", snap); err != nil {
		t.Fatal(err)
	}
	// Written after the snapshot: must not show in what is restored.
	writeDevice(t, src, 0, pattern(1<<20, 3))

	st, err := os.Stat(l.SnapshotFile(snap))
	if err != nil || st.Size() != DefaultSize {
		t.Fatalf("snapshot file %v %v", st, err)
	}
	if used := st.Sys().(*syscall.Stat_t).Blocks * 512; used > 64<<20 {
		t.Errorf("snapshot file is not sparse: %d bytes allocated", used)
	}

	if err := l.Restore(ctx, snap, "copy"); err != nil {
		t.Fatal(err)
	}
	cp := plugged(ctx, t, l, "ns/vm-b", "copy")
	if got, want := sumDevice(t, cp, 0, len(head)), sum(head); got != want {
		t.Errorf("restored head %s, want %s", got, want)
	}
	if got, want := sumDevice(t, cp, far, len(tail)), sum(tail); got != want {
		t.Errorf("restored tail %s, want %s", got, want)
	}
	if got, want := sumDevice(t, cp, 300<<20, 1<<20), sum(make([]byte, 1<<20)); got != want {
		t.Errorf("restored hole is not zero")
	}
	if size := deviceSize(t, cp); size != DefaultSize {
		t.Errorf("restored size %d", size)
	}
	// Restoring over a plugged claim would go unseen by its loop device.
	if err := l.Restore(ctx, snap, "copy"); err == nil || !strings.Contains(err.Error(), "plugged") {
		t.Errorf("restore over a plugged claim: %v", err)
	}

	// A larger claim restored from the snapshot grows to its size at Plug.
	if err := l.Restore(ctx, snap, "big"); err != nil {
		t.Fatal(err)
	}
	big := plugged(ctx, t, l, "ns/vm-b", "big")
	if size := deviceSize(t, big); size != 2*DefaultSize {
		t.Errorf("grown restore size %d", size)
	}
	if got, want := sumDevice(t, big, far, len(tail)), sum(tail); got != want {
		t.Errorf("grown restore tail %s, want %s", got, want)
	}

	// A claim never plugged snapshots as an empty disk.
	if err := l.Snapshot(ctx, "never", "guests/empty"); err != nil {
		t.Fatal(err)
	}
	if err := l.Restore(ctx, "guests/empty", "fresh"); err != nil {
		t.Fatal(err)
	}
	fresh := plugged(ctx, t, l, "ns/vm-c", "fresh")
	if got, want := sumDevice(t, fresh, 0, 1<<20), sum(make([]byte, 1<<20)); got != want || deviceSize(t, fresh) != DefaultSize {
		t.Errorf("restore of an empty snapshot: %s (size %d)", got, deviceSize(t, fresh))
	}

	// Names of any length and character make distinct files.
	long := "guests/" + strings.Repeat("x", 253)
	if err := l.Snapshot(ctx, "src", long); err != nil {
		t.Fatal(err)
	}
	if l.SnapshotFile(long) == l.SnapshotFile(long+"y") || l.SnapshotFile("a/b") == l.SnapshotFile("a_b") {
		t.Error("snapshot file names collide")
	}

	if err := l.DeleteSnapshot(ctx, snap); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(l.SnapshotFile(snap)); !os.IsNotExist(err) {
		t.Errorf("snapshot file after delete: %v", err)
	}
	if err := l.DeleteSnapshot(ctx, snap); err != nil {
		t.Errorf("second delete: %v", err)
	}
	if err := l.Restore(ctx, snap, "other"); err == nil {
		t.Error("restore of a deleted snapshot succeeded")
	}

	if err := l.Close(ctx); err != nil {
		t.Fatal(err)
	}
	left, _ := filepath.Glob(filepath.Join(root, "host", "*"+snapshotExt))
	if len(left) > 0 {
		t.Errorf("Close left snapshot files %v", left)
	}
	if _, err := os.Stat(l.BackingFile("copy")); err != nil {
		t.Errorf("Close removed a backing file: %v", err)
	}
}
