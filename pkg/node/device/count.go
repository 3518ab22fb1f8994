package device

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// hotplugPrefix starts the by-id name of a disk hot-plugged the way this
// driver (and upstream) plugs: SCSI, no serial (see names.go).
const hotplugPrefix = scsiPrefix + "drive-ua-"

// OtherDisks counts the disks of this VM that the guest sees and that are
// not hot-plugged volumes: the root and cloud-init disks, CD-ROMs, disks
// plugged with a serial. Each takes one of the VM's disk slots in KubeVirt,
// so the room left for volumes is KubeVirt's limit minus this count. A disk
// is an entry of <sysfs>/block with a device behind it (loop, device-mapper
// and RAM disks have none); a hot-plugged volume is one that a by-id link of
// hotplugPrefix points at.
func (f *Finder) OtherDisks() (int, error) {
	volumes := map[string]bool{}
	entries, err := os.ReadDir(f.byIDDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return 0, err
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), hotplugPrefix) {
			continue
		}
		if target, err := os.Readlink(filepath.Join(f.byIDDir, e.Name())); err == nil {
			volumes[filepath.Base(target)] = true
		}
	}
	block := filepath.Join(f.sysfsRoot, "block")
	disks, err := os.ReadDir(block)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, d := range disks {
		if _, err := os.Stat(filepath.Join(block, d.Name(), "device")); err != nil || volumes[d.Name()] {
			continue
		}
		n++
	}
	return n, nil
}
