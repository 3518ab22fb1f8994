// Package device finds the disk KubeVirt hot-plugged for a volume and tells
// whether it is still present or held by someone.
package device

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"
)

// Defaults of the host paths the node reads; every caller takes them from
// here.
const (
	DefaultByIDDir   = "/dev/disk/by-id"
	DefaultSysfsRoot = "/sys"
)

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

// FromPath stats path (following symlinks, as a by-id link must be) and
// returns the block device it is.
func FromPath(path string) (Device, error) {
	d, err := stat(path, unix.Stat)
	if err != nil {
		return Device{}, err
	}
	if resolved, err := filepath.EvalSymlinks(path); err == nil {
		d.Path = resolved
	}
	return d, nil
}

// FromPathNoFollow is FromPath for a path the driver was handed (a target or
// staging path): a symlink there is not a block device.
func FromPathNoFollow(path string) (Device, error) {
	return stat(path, unix.Lstat)
}

func stat(path string, statFn func(string, *unix.Stat_t) error) (Device, error) {
	var st unix.Stat_t
	if err := statFn(path, &st); err != nil {
		return Device{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return Device{}, fmt.Errorf("%s is not a block device", path)
	}
	return Device{Path: path, Major: unix.Major(st.Rdev), Minor: unix.Minor(st.Rdev)}, nil
}

// NotFoundError says what was looked for, where, and for how long.
type NotFoundError struct {
	VolumeID string
	// Names are the by-id entries that would have identified the disk.
	Names  []string
	Dir    string
	Waited time.Duration
	// Reason, when set, says why no disk can ever be found.
	Reason string
}

func (e *NotFoundError) Error() string {
	if e.Reason != "" {
		return fmt.Sprintf("no disk for volume %s: %s", e.VolumeID, e.Reason)
	}
	wait := ""
	if e.Waited > 0 {
		wait = fmt.Sprintf(" after waiting %s", e.Waited.Round(time.Millisecond))
	}
	return fmt.Sprintf("no disk for volume %s in %s%s: looked for an entry named exactly %s; the volume is not (yet) hot-plugged into this VM",
		e.VolumeID, e.Dir, wait, strings.Join(e.Names, " or "))
}

func (e *NotFoundError) Unwrap() error { return ErrNotFound }

// StillArriving reports a disk that Wait waited for in vain but that may
// still come: the hotplug is in progress or udev has not linked it yet.
func (e *NotFoundError) StillArriving() bool { return e.Reason == "" && e.Waited > 0 }

// AmbiguousError is returned when the by-id entries cannot name one disk for
// the volume: they point at different disks, at a partition, or only a
// truncated serial matches. Picking one could mount the wrong disk.
type AmbiguousError struct {
	VolumeID string
	Matches  []Device
	Reason   string
	// Truncated is set when the only match is a truncated virtio serial; the
	// exact entry may still appear.
	Truncated bool
}

func (e *AmbiguousError) Error() string {
	parts := make([]string, 0, len(e.Matches))
	for _, m := range e.Matches {
		parts = append(parts, m.String())
	}
	return fmt.Sprintf("volume %s cannot be told apart from another disk: %s: %s; refusing to pick one",
		e.VolumeID, e.Reason, strings.Join(parts, ", "))
}

// FinderOptions configures a Finder.
type FinderOptions struct {
	// ByIDDir is the by-id directory (default DefaultByIDDir).
	ByIDDir string
	// SysfsRoot is where sysfs is mounted (default DefaultSysfsRoot); used to
	// tell whether a device still exists and whether it is a partition.
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
		f.byIDDir = DefaultByIDDir
	}
	if f.sysfsRoot == "" {
		f.sysfsRoot = DefaultSysfsRoot
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

// Lookup finds the disk of volumeID without waiting. Only by-id entries whose
// whole name is one KubeVirt's disk of that volume gets (see names.go) count;
// entries that merely contain the ID are other volumes' disks ("pvc-1" is in
// "pvc-10"). Several different disks, a partition, or only a truncated serial
// are an *AmbiguousError; nothing is a *NotFoundError.
func (f *Finder) Lookup(volumeID string) (Device, error) {
	if errs := validation.IsDNS1123Label(volumeID); len(errs) > 0 {
		// KubeVirt's disk and volume names are DNS-1123 labels (v1.7.0
		// pkg/storage/admitters/disks.go:293 validateDiskNameAsContainerName),
		// and the controller names the disk after the volume ID.
		return Device{}, &NotFoundError{VolumeID: volumeID, Dir: f.byIDDir,
			Reason: fmt.Sprintf("the volume ID cannot be a KubeVirt disk name, so no disk is ever hot-plugged under it (%s)", strings.Join(errs, "; "))}
	}
	exact := LinkNames(volumeID)
	found, err := f.resolve(exact)
	if err != nil {
		return Device{}, err
	}
	for _, d := range found {
		if part, err := f.isPartition(d); err != nil {
			return Device{}, err
		} else if part {
			// The disk link of volume "x-part1" is the partition link of
			// volume "x": udev gives the name to one of them.
			return Device{}, &AmbiguousError{VolumeID: volumeID, Matches: found,
				Reason: fmt.Sprintf("%s points at a partition, so the name is shared with a partition of another volume's disk", d.Link)}
		}
	}
	switch len(found) {
	case 1:
		return found[0], nil
	case 0:
	default:
		return Device{}, &AmbiguousError{VolumeID: volumeID, Matches: found, Reason: "the exact by-id names of the volume point at different disks"}
	}
	if name, ok := TruncatedVirtioName(volumeID); ok {
		if ds, err := f.resolve([]string{name}); err == nil && len(ds) > 0 {
			return Device{}, &AmbiguousError{VolumeID: volumeID, Matches: ds, Truncated: true,
				Reason: fmt.Sprintf("only %s matches, a virtio serial cut to %d bytes that every volume starting with the same %d characters shares", name, VirtioSerialBytes, VirtioSerialBytes)}
		}
	}
	return Device{}, &NotFoundError{VolumeID: volumeID, Names: exact, Dir: f.byIDDir}
}

// resolve returns the distinct devices the named entries point at; missing
// entries and dangling links (a removed disk) are skipped.
func (f *Finder) resolve(names []string) ([]Device, error) {
	var found []Device
	for _, name := range names {
		link := filepath.Join(f.byIDDir, name)
		if _, err := os.Lstat(link); err != nil {
			if os.IsNotExist(err) {
				continue
			}
			return nil, fmt.Errorf("look at %s: %w", link, err)
		}
		d, err := FromPath(link)
		if err != nil {
			continue
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
	return found, nil
}

// isPartition asks sysfs; without sysfs nothing is a partition.
func (f *Finder) isPartition(d Device) (bool, error) {
	_, err := os.Stat(filepath.Join(f.sysfsRoot, "dev", "block", fmt.Sprintf("%d:%d", d.Major, d.Minor), "partition"))
	switch {
	case err == nil:
		return true, nil
	case os.IsNotExist(err):
		return false, nil
	default:
		return false, err
	}
}

// Wait polls Lookup until the disk appears, or until the finder's bound or
// ctx's deadline passes (a NotFoundError naming the wait), or ctx is
// cancelled (ctx's error).
func (f *Finder) Wait(ctx context.Context, volumeID string) (Device, error) {
	logger := klog.FromContext(ctx)
	start := time.Now()
	deadline := time.NewTimer(f.wait)
	defer deadline.Stop()
	tick := time.NewTicker(f.interval)
	defer tick.Stop()
	logged := false
	for {
		d, err := f.Lookup(volumeID)
		if err == nil {
			if logged {
				logger.Info("disk appeared", "device", d.Path, "waited", time.Since(start).Round(time.Millisecond))
			}
			return d, nil
		}
		// Only "not there (exactly) yet" is worth waiting for.
		var nf *NotFoundError
		var amb *AmbiguousError
		switch {
		case errors.As(err, &nf) && nf.Reason == "":
		case errors.As(err, &amb) && amb.Truncated:
		default:
			return Device{}, err
		}
		if !logged {
			logger.V(2).Info("waiting for the hot-plugged disk to appear", "dir", f.byIDDir)
			logged = true
		}
		select {
		case <-ctx.Done():
			// The caller's deadline ends a wait as the finder's bound
			// does; only a cancelled caller gets the context's error.
			if nf != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
				nf.Waited = time.Since(start)
				return Device{}, err
			}
			return Device{}, fmt.Errorf("waiting for the disk of volume %s in %s: %w", volumeID, f.byIDDir, ctx.Err())
		case <-deadline.C:
			if nf != nil {
				nf.Waited = time.Since(start)
			}
			return Device{}, err
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
