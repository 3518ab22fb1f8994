package device

import (
	"os"
	"path/filepath"
	"testing"
)

// The disks that take a VM's slots besides hot-plugged volumes: every disk
// of <sysfs>/block with a device (root, cloud-init, CD-ROM, a disk plugged
// with a serial), not the hot-plugged volumes, not loop devices.
func TestOtherDisks(t *testing.T) {
	root := t.TempDir()
	sys, byID := filepath.Join(root, "sys"), filepath.Join(root, "by-id")
	for name, real := range map[string]bool{"vda": true, "vdb": true, "sr0": true, "sda": true, "sdb": true, "sdc": true, "loop0": false, "dm-0": false} {
		dir := filepath.Join(sys, "block", name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if real {
			if err := os.WriteFile(filepath.Join(dir, "device"), nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.MkdirAll(byID, 0o755); err != nil {
		t.Fatal(err)
	}
	for link, target := range map[string]string{
		hotplugPrefix + "pvc-1":       "../../sda",
		hotplugPrefix + "pvc-1-part1": "../../sda1",
		hotplugPrefix + "pvc-2":       "../../sdb",
		scsiPrefix + "data":           "../../sdc", // plugged with a serial: not a volume
		"virtio-rootdisk":             "../../vda",
	} {
		if err := os.Symlink(target, filepath.Join(byID, link)); err != nil {
			t.Fatal(err)
		}
	}
	f := NewFinder(FinderOptions{ByIDDir: byID, SysfsRoot: sys})
	got, err := f.OtherDisks()
	if err != nil {
		t.Fatal(err)
	}
	if got != 4 { // vda, vdb, sr0, sdc
		t.Errorf("other disks %d, want 4 (vda, vdb, sr0, sdc)", got)
	}
}
