package sweeper

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
)

func TestMain(m *testing.M) { nodetest.Main(m) }

type recorder struct {
	mu     sync.Mutex
	events []string
}

func (r *recorder) Event(_ context.Context, volumeID, eventType, reason, _ string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, volumeID+"/"+eventType+"/"+reason)
}

// After a driver restart nothing is tracked: kubelet's vol_data.json tells
// which staging mounts are ours. Mounts of other drivers, and ours whose disk
// is still there, are left alone; a volume busy with a node operation waits.
// A staging-looking path outside the kubelet root and a tmpfs
// with a forged vol_data.json are never candidates.
func TestSweepAfterRestart(t *testing.T) {
	nodetest.RequireRealDevices(t)
	_, ctx := ktesting.NewTestContext(t)
	root := t.TempDir()
	disks, err := loopdisk.New(loopdisk.Options{BackingDir: filepath.Join(root, "host"), ByIDRoot: filepath.Join(root, "by-id"),
		Size: func(context.Context, string) (int64, error) { return 16 << 20, nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = disks.Close(context.Background()) })
	nodetest.CleanupMounts(t, root)

	m := mounter.New(mounter.Options{})
	staging := map[string]string{}
	csiDir := filepath.Join(root, "kubelet/plugins/kubernetes.io/csi")
	for vol, driver := range map[string]string{"pvc-gone": "driver.harvesterhci.io", "pvc-here": "driver.harvesterhci.io", "pvc-foreign": "other.csi.io", "pvc-busy": "driver.harvesterhci.io", "pvc-outside": "driver.harvesterhci.io"} {
		if err := disks.Plug(ctx, "vm", vol, vol); err != nil {
			t.Fatal(err)
		}
		dev, _ := disks.Device("vm", vol)
		dir := filepath.Join(csiDir, driver, vol)
		if vol == "pvc-outside" {
			dir = filepath.Join(root, "elsewhere/plugins/kubernetes.io/csi", driver, vol)
		}
		writeVolData(t, dir, driver, vol)
		staging[vol] = filepath.Join(dir, "globalmount")
		if _, err := m.FormatAndMount(ctx, dev, staging[vol], "", nil); err != nil {
			t.Fatal(err)
		}
	}
	// A tmpfs has no device at all, which Present reports as gone.
	forged := filepath.Join(csiDir, "driver.harvesterhci.io", "forged")
	writeVolData(t, forged, "driver.harvesterhci.io", "pvc-forged")
	staging["pvc-forged"] = filepath.Join(forged, "globalmount")
	nodetest.Run(t, "mkdir", "-p", staging["pvc-forged"])
	nodetest.Run(t, "mount", "-t", "tmpfs", "tmpfs", staging["pvc-forged"])
	for _, vol := range []string{"pvc-gone", "pvc-foreign", "pvc-busy", "pvc-outside"} {
		if err := disks.Unplug(ctx, "vm", vol); err != nil {
			t.Fatal(err)
		}
	}

	rec := &recorder{}
	busy := map[string]bool{"pvc-busy": true}
	s, err := New(Options{
		DriverName: "driver.harvesterhci.io", KubeletRoot: filepath.Join(root, "kubelet"), Confirm: 10 * time.Millisecond, Recorder: rec,
		Finder:  device.NewFinder(device.FinderOptions{ByIDDir: disks.ByIDDir("vm")}),
		Mounter: m,
		TryLock: func(vol string) (func(), bool) { return func() {}, !busy[vol] },
	})
	if err != nil {
		t.Fatal(err)
	}
	swept, err := s.Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(swept) != 1 || swept[0].VolumeID != "pvc-gone" || swept[0].StagingPath != staging["pvc-gone"] {
		t.Fatalf("swept %+v", swept)
	}
	for vol, want := range map[string]bool{"pvc-gone": false, "pvc-here": true, "pvc-foreign": true, "pvc-busy": true, "pvc-outside": true, "pvc-forged": true} {
		if got, _ := m.IsMountPoint(staging[vol]); got != want {
			t.Errorf("%s mounted=%v, want %v", vol, got, want)
		}
	}
	if len(rec.events) != 1 || rec.events[0] != "pvc-gone/Warning/"+ReasonStaleStagingRemoved {
		t.Fatalf("events %v", rec.events)
	}

	busy["pvc-busy"] = false
	if swept, _ := s.Sweep(ctx); len(swept) != 1 || swept[0].VolumeID != "pvc-busy" {
		t.Fatalf("second sweep %+v", swept)
	}
	if swept, _ := s.Sweep(ctx); len(swept) != 0 {
		t.Fatalf("third sweep %+v", swept)
	}
	for _, vol := range []string{"pvc-here", "pvc-foreign", "pvc-outside", "pvc-forged"} {
		if err := m.Unmount(ctx, staging[vol]); err != nil {
			t.Fatal(err)
		}
	}
}

func writeVolData(t *testing.T, dir, driver, vol string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	vd := `{"driverName":"` + driver + `","volumeHandle":"` + vol + `"}`
	if err := os.WriteFile(filepath.Join(dir, "vol_data.json"), []byte(vd), 0o600); err != nil {
		t.Fatal(err)
	}
}
