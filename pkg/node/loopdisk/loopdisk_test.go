package loopdisk

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/nodetest"
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
