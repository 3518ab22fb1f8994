// Package device finds the disk KubeVirt hot-plugged for a volume and tells
// whether it is still present or held by someone.
package device

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// DriveAliasPrefix is what QEMU puts in the SCSI serial (and so in the by-id
// name) of a hot-plugged disk that has no explicit serial: KubeVirt names the
// drive "ua-<volume name>", and upstream names the volume after its ID.
const DriveAliasPrefix = "drive-ua-"

// ErrNotFound is wrapped by the errors returned when no disk is found.
var ErrNotFound = errors.New("disk not found")

// Device is a block device node.
type Device struct {
	// Path is the resolved device node, e.g. /dev/sdb or /dev/loop3.
	Path string
	// Link is the by-id entry the device was found through, if any.
	Link         string
	Major, Minor uint32
}

func (d Device) String() string {
	if d.Link != "" {
		return fmt.Sprintf("%s (%d:%d via %s)", d.Path, d.Major, d.Minor, d.Link)
	}
	return fmt.Sprintf("%s (%d:%d)", d.Path, d.Major, d.Minor)
}

// Same reports whether both values name the same device number.
func (d Device) Same(o Device) bool { return d.Major == o.Major && d.Minor == o.Minor }

// FromPath stats path (following symlinks) and returns the block device it is.
func FromPath(path string) (Device, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return Device{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return Device{}, fmt.Errorf("%s is not a block device", path)
	}
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		resolved = path
	}
	return Device{Path: resolved, Major: unix.Major(st.Rdev), Minor: unix.Minor(st.Rdev)}, nil
}

// NotFoundError says what was looked for, where, and for how long.
type NotFoundError struct {
	VolumeID string
	Serial   string
	Dir      string
	Waited   time.Duration
}

func (e *NotFoundError) Error() string {
	what := fmt.Sprintf("an entry whose name contains %q", e.VolumeID)
	if e.Serial != "" {
		what = fmt.Sprintf("an entry for disk serial %q or whose name contains %q", e.Serial, e.VolumeID)
	}
	wait := ""
	if e.Waited > 0 {
		wait = fmt.Sprintf(" after waiting %s", e.Waited.Round(time.Millisecond))
	}
	return fmt.Sprintf("no disk for volume %s in %s%s: looked for %s; the volume is not (yet) hot-plugged into this VM",
		e.VolumeID, e.Dir, wait, what)
}

func (e *NotFoundError) Unwrap() error { return ErrNotFound }

// AmbiguousError is returned when by-id entries for one volume point at
// different devices; picking one could mount the wrong disk.
type AmbiguousError struct {
	VolumeID string
	Matches  []Device
}

func (e *AmbiguousError) Error() string {
	parts := make([]string, 0, len(e.Matches))
	for _, m := range e.Matches {
		parts = append(parts, m.String())
	}
	return fmt.Sprintf("volume %s matches several different disks: %s", e.VolumeID, strings.Join(parts, ", "))
}

// FinderOptions configures a Finder.
type FinderOptions struct {
	// ByIDDir is the by-id directory (default /dev/disk/by-id).
	ByIDDir string
	// SysfsRoot is where sysfs is mounted (default /sys); used to tell whether
	// a device still exists.
	SysfsRoot string
	// Wait bounds how long Wait polls for a disk to appear (default 15s):
	// udev links the disk shortly after KubeVirt reports the hotplug Ready.
	Wait time.Duration
	// PollInterval is the delay between looks (default 200ms).
	PollInterval time.Duration
}

// Finder looks up hot-plugged disks in a by-id directory.
type Finder struct {
	byIDDir   string
	sysfsRoot string
	wait      time.Duration
	interval  time.Duration
}

// NewFinder returns a Finder with defaults applied.
func NewFinder(o FinderOptions) *Finder {
	f := &Finder{byIDDir: o.ByIDDir, sysfsRoot: o.SysfsRoot, wait: o.Wait, interval: o.PollInterval}
	if f.byIDDir == "" {
		f.byIDDir = "/dev/disk/by-id"
	}
	if f.sysfsRoot == "" {
		f.sysfsRoot = "/sys"
	}
	if f.wait <= 0 {
		f.wait = 15 * time.Second
	}
	if f.interval <= 0 {
		f.interval = 200 * time.Millisecond
	}
	return f
}

// ByIDDir is the directory the finder searches.
func (f *Finder) ByIDDir() string { return f.byIDDir }

var partSuffix = regexp.MustCompile(`-part[0-9]+$`)

// Lookup finds the disk of volumeID (or with the given disk serial) without
// waiting. The serial is checked first because it is exact; the name match is
// what upstream used and still finds disks attached before the upgrade.
func (f *Finder) Lookup(volumeID, serial string) (Device, error) {
	entries, err := os.ReadDir(f.byIDDir)
	if err != nil && !os.IsNotExist(err) {
		return Device{}, fmt.Errorf("read %s: %w", f.byIDDir, err)
	}
	var bySerial, byAlias, byName []string
	for _, e := range entries {
		name := e.Name()
		if partSuffix.MatchString(name) {
			continue // a partition of the disk, never the disk itself
		}
		switch {
		case serial != "" && (name == serial || strings.HasSuffix(name, "_"+serial) || strings.HasSuffix(name, "-"+serial)):
			bySerial = append(bySerial, name)
		case strings.HasSuffix(name, DriveAliasPrefix+volumeID):
			byAlias = append(byAlias, name)
		case strings.Contains(name, volumeID):
			byName = append(byName, name)
		}
	}
	for _, group := range [][]string{bySerial, byAlias, byName} {
		d, ok, err := f.resolveGroup(volumeID, group)
		if err != nil || ok {
			return d, err
		}
	}
	return Device{}, &NotFoundError{VolumeID: volumeID, Serial: serial, Dir: f.byIDDir}
}

func (f *Finder) resolveGroup(volumeID string, names []string) (Device, bool, error) {
	sort.Strings(names)
	var found []Device
	for _, name := range names {
		link := filepath.Join(f.byIDDir, name)
		d, err := FromPath(link)
		if err != nil {
			continue // dangling link left behind by a removed disk
		}
		d.Link = link
		dup := false
		for _, o := range found {
			dup = dup || o.Same(d)
		}
		if !dup {
			found = append(found, d)
		}
	}
	switch len(found) {
	case 0:
		return Device{}, false, nil
	case 1:
		return found[0], true, nil
	default:
		return Device{}, false, &AmbiguousError{VolumeID: volumeID, Matches: found}
	}
}

// Wait polls Lookup until the disk appears, the finder's bound passes (a
// NotFoundError naming the wait) or ctx ends (ctx's error).
func (f *Finder) Wait(ctx context.Context, volumeID, serial string) (Device, error) {
	logger := klog.FromContext(ctx)
	start := time.Now()
	deadline := time.NewTimer(f.wait)
	defer deadline.Stop()
	tick := time.NewTicker(f.interval)
	defer tick.Stop()
	logged := false
	for {
		d, err := f.Lookup(volumeID, serial)
		if err == nil {
			if logged {
				logger.Info("disk appeared", "device", d.Path, "waited", time.Since(start).Round(time.Millisecond))
			}
			return d, nil
		}
		if !errors.Is(err, ErrNotFound) {
			return Device{}, err
		}
		if !logged {
			logger.V(2).Info("waiting for the hot-plugged disk to appear", "serial", serial, "dir", f.byIDDir)
			logged = true
		}
		select {
		case <-ctx.Done():
			return Device{}, fmt.Errorf("waiting for the disk of volume %s in %s: %w", volumeID, f.byIDDir, ctx.Err())
		case <-deadline.C:
			return Device{}, &NotFoundError{VolumeID: volumeID, Serial: serial, Dir: f.byIDDir, Waited: time.Since(start)}
		case <-tick.C:
		}
	}
}

// Present reports whether d is still attached to this node. A device counts as
// gone when sysfs no longer has it, when it is a loop device without backing
// file, or when no by-id entry points at it any more (how a hot-unplug looks
// when something still holds the block device node). reason says which.
// Checks whose directory is missing (a misconfigured path) are skipped rather
// than counted as "gone", because callers unmount on "gone".
func (f *Finder) Present(d Device) (present bool, reason string, err error) {
	sysDevBlock := filepath.Join(f.sysfsRoot, "dev", "block")
	if _, err := os.Stat(sysDevBlock); err == nil {
		node := filepath.Join(sysDevBlock, fmt.Sprintf("%d:%d", d.Major, d.Minor))
		if _, err := os.Stat(node); os.IsNotExist(err) {
			return false, fmt.Sprintf("block device %d:%d no longer exists", d.Major, d.Minor), nil
		}
		if _, err := os.Stat(filepath.Join(node, "loop")); err == nil {
			if _, err := os.Stat(filepath.Join(node, "loop", "backing_file")); os.IsNotExist(err) {
				return false, fmt.Sprintf("loop device %d:%d has been detached", d.Major, d.Minor), nil
			}
		}
	}
	entries, err := os.ReadDir(f.byIDDir)
	if err != nil {
		if os.IsNotExist(err) {
			return true, "", nil
		}
		return false, "", fmt.Errorf("read %s: %w", f.byIDDir, err)
	}
	for _, e := range entries {
		o, err := FromPath(filepath.Join(f.byIDDir, e.Name()))
		if err == nil && o.Same(d) {
			return true, "", nil
		}
	}
	return false, fmt.Sprintf("no entry in %s points at %d:%d any more", f.byIDDir, d.Major, d.Minor), nil
}
