// Package loopdisk makes "hot-plugged disks" out of loop devices for the
// KubeVirt simulator and node tests: one sparse backing file per host PVC
// (kept across unplug and plug, like a Longhorn volume), a loop device per
// attachment, and the by-id link QEMU's SCSI disk would get, in a per-VM by-id
// directory. It implements the simulator's DiskHook (Plug/Unplug) and
// SnapshotHook (Snapshot/Restore/DeleteSnapshot): a snapshot is a sparse copy
// of a claim's backing file, kept next to it; and its CloneHook (Clone): a
// clone's backing file starts as a sparse copy of its source's.
package loopdisk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"k8s.io/klog/v2"
)

// LinkPrefix is the by-id name prefix of a KubeVirt hot-plugged SCSI disk
// without explicit serial; the volume name follows.
const LinkPrefix = "scsi-0QEMU_QEMU_HARDDISK_drive-ua-"

// LinkName is the by-id entry name of volume's disk.
func LinkName(volume string) string { return LinkPrefix + volume }

// DefaultSize is the size of a new backing file when Options.Size is nil.
const DefaultSize int64 = 1 << 30

// Options configures LoopDisks.
type Options struct {
	// BackingDir holds one sparse <claim>.img per host PVC and one sparse
	// *.snap per snapshot (see SnapshotFile).
	BackingDir string
	// ByIDRoot holds one by-id directory per VM: <ByIDRoot>/<vm>.
	ByIDRoot string
	// Size returns the size of claimName's backing file when it is created
	// or plugged; nil means DefaultSize. A larger size grows the file.
	Size func(ctx context.Context, claimName string) (int64, error)
}

// LoopDisks attaches and detaches loop devices. Its state lives in the
// filesystem (links and loop devices), so a restarted simulator can unplug
// what an earlier one plugged.
type LoopDisks struct {
	o  Options
	mu sync.Mutex // serialises plug/unplug so two calls never race on one link
}

// New checks that loop devices can be used and creates the directories.
func New(o Options) (*LoopDisks, error) {
	if o.BackingDir == "" || o.ByIDRoot == "" {
		return nil, errors.New("loopdisk: BackingDir and ByIDRoot are required")
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("loopdisk: loop devices need root")
	}
	if _, err := exec.LookPath("losetup"); err != nil {
		return nil, fmt.Errorf("loopdisk: %w", err)
	}
	// Absolute, resolved paths: the kernel reports a loop device's backing
	// file that way and Plug compares against it.
	for _, d := range []*string{&o.BackingDir, &o.ByIDRoot} {
		if err := os.MkdirAll(*d, 0o750); err != nil {
			return nil, err
		}
		abs, err := filepath.Abs(*d)
		if err != nil {
			return nil, err
		}
		if *d, err = filepath.EvalSymlinks(abs); err != nil {
			return nil, err
		}
	}
	return &LoopDisks{o: o}, nil
}

// ByIDDir is the by-id directory of vm, to give that node's driver as its
// --by-id-dir. A vm of the form "namespace/name" makes nested directories.
func (l *LoopDisks) ByIDDir(vm string) string { return filepath.Join(l.o.ByIDRoot, vm) }

// BackingFile is the backing file of claimName.
func (l *LoopDisks) BackingFile(claimName string) string {
	return filepath.Join(l.o.BackingDir, claimName+".img")
}

func (l *LoopDisks) link(vm, volume string) string {
	return filepath.Join(l.ByIDDir(vm), LinkName(volume))
}

// Plug attaches claimName's backing file to a new loop device and links it
// as volume's disk in vm's by-id directory. Plugging what is already plugged
// is a no-op.
func (l *LoopDisks) Plug(ctx context.Context, vm, volume, claimName string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	logger := klog.FromContext(ctx).WithValues("vm", vm, "volume", volume, "claim", claimName)
	file := l.BackingFile(claimName)
	link := l.link(vm, volume)
	if dev, err := filepath.EvalSymlinks(link); err == nil {
		if bf, _ := backingFile(dev); bf == file {
			return nil
		}
		// A link to something else (a dead loop device) is replaced.
		_ = os.Remove(link)
	}
	size := DefaultSize
	if l.o.Size != nil {
		s, err := l.o.Size(ctx, claimName)
		if err != nil {
			return fmt.Errorf("size of %s: %w", claimName, err)
		}
		if s > 0 {
			size = s
		}
	}
	if err := ensureSize(file, size); err != nil {
		return err
	}
	out, err := run(ctx, "losetup", "--find", "--show", file)
	if err != nil {
		return err
	}
	dev := strings.TrimSpace(out)
	if err := os.MkdirAll(l.ByIDDir(vm), 0o750); err != nil {
		_, _ = run(ctx, "losetup", "-d", dev)
		return err
	}
	if err := os.Symlink(dev, link); err != nil {
		_, _ = run(ctx, "losetup", "-d", dev)
		return err
	}
	logger.Info("disk plugged", "device", dev, "link", link)
	return nil
}

// Unplug removes volume's by-id link from vm and detaches its loop device.
// If the guest still has the device open (mounted), the kernel detaches it
// only when the last user goes, as a real unplugged disk stays referenced.
func (l *LoopDisks) Unplug(ctx context.Context, vm, volume string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	logger := klog.FromContext(ctx).WithValues("vm", vm, "volume", volume)
	link := l.link(vm, volume)
	dev, err := filepath.EvalSymlinks(link)
	if err != nil {
		if _, lerr := os.Lstat(link); lerr == nil {
			_ = os.Remove(link) // dangling
		}
		return nil
	}
	if err := os.Remove(link); err != nil && !os.IsNotExist(err) {
		return err
	}
	if _, err := run(ctx, "losetup", "-d", dev); err != nil {
		return err
	}
	logger.Info("disk unplugged", "device", dev)
	return nil
}

// Device returns the loop device currently plugged as volume into vm.
func (l *LoopDisks) Device(vm, volume string) (string, bool) {
	dev, err := filepath.EvalSymlinks(l.link(vm, volume))
	return dev, err == nil
}

// Grow enlarges claimName's backing file to size and makes every loop device
// on it pick up the new size, like an online volume expansion.
func (l *LoopDisks) Grow(ctx context.Context, claimName string, size int64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	file := l.BackingFile(claimName)
	if err := ensureSize(file, size); err != nil {
		return err
	}
	out, err := run(ctx, "losetup", "--noheadings", "--output", "NAME", "--associated", file)
	if err != nil {
		return err
	}
	for _, dev := range strings.Fields(out) {
		if _, err := run(ctx, "losetup", "--set-capacity", dev); err != nil {
			return err
		}
		klog.FromContext(ctx).Info("disk grown", "claim", claimName, "device", dev, "size", size)
	}
	return nil
}

// Close unplugs every disk of every VM and removes every snapshot file; it is
// for test cleanup. VM names may contain a slash (the simulator passes
// "namespace/name"), so by-id directories are found at any depth.
func (l *LoopDisks) Close(ctx context.Context) error {
	var errs []error
	err := filepath.WalkDir(l.o.ByIDRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) {
				return nil
			}
			return err
		}
		vol, ok := strings.CutPrefix(d.Name(), LinkPrefix)
		if !ok || d.IsDir() {
			return nil
		}
		vm, err := filepath.Rel(l.o.ByIDRoot, filepath.Dir(path))
		if err != nil {
			return err
		}
		errs = append(errs, l.Unplug(ctx, vm, vol))
		return nil
	})
	errs = append(errs, err, l.removeSnapshots())
	return errors.Join(errs...)
}

func ensureSize(file string, size int64) error {
	f, err := os.OpenFile(file, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if st.Size() < size {
		return f.Truncate(size) // sparse: no blocks are written
	}
	return nil
}

// backingFile returns the backing file of loop device dev, or "" when it is
// not an attached loop device.
func backingFile(dev string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

func run(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}
