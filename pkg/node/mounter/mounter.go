// Package mounter formats, mounts, unmounts and grows filesystems on the
// node. It runs the standard tools (blkid, mkfs.*, mount, resize2fs,
// xfs_growfs) so that mount options mean exactly what they mean to mount(8),
// and reads the mount table itself.
//
// Paths come from requests, so two rules hold everywhere: a path is always
// passed after "--", never where a tool could read it as an option, and a
// symlink at a mount target, bind source or unmount path is never followed.
// mount(8) is given the target as /proc/self/fd/N of a descriptor opened with
// O_NOFOLLOW (and --no-canonicalize, so the kernel, not mount(8), resolves
// it: to exactly the inode that was checked), and unmounts use
// UMOUNT_NOFOLLOW.
package mounter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
)

// DefaultFSType is used when the volume capability names no filesystem.
const DefaultFSType = "ext4"

// Options configures a Mounter.
type Options struct {
	// MountInfoPath is the mount table consulted (default /proc/self/mountinfo).
	MountInfoPath string
	// UnmountAttempts bounds "unmount until not a mount point" (default 10):
	// a path can have several mounts stacked on it.
	UnmountAttempts int
}

// Mounter performs the filesystem operations of the node service.
type Mounter struct {
	mountInfo       string
	unmountAttempts int
}

// New returns a Mounter with defaults applied.
func New(o Options) *Mounter {
	m := &Mounter{mountInfo: o.MountInfoPath, unmountAttempts: o.UnmountAttempts}
	if m.mountInfo == "" {
		m.mountInfo = mountinfo.SelfPath
	}
	if m.unmountAttempts <= 0 {
		m.unmountAttempts = 10
	}
	return m
}

// SupportedFSType reports whether fsType can be formatted and grown here.
func SupportedFSType(fsType string) bool {
	switch fsType {
	case "", "ext4", "ext3", "xfs":
		return true
	}
	return false
}

// MismatchError is returned when a disk carries something other than the
// requested filesystem; the disk is left untouched.
type MismatchError struct {
	Device, Want, Have string
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("%s already holds %s, not the requested %s; refusing to reformat it", e.Device, e.Have, e.Want)
}

// SymlinkError is returned for a path that is a symbolic link where the
// driver needs the path itself; nothing is done through the link.
type SymlinkError struct{ Path string }

func (e *SymlinkError) Error() string {
	return fmt.Sprintf("%s is a symbolic link; refusing to follow it", e.Path)
}

func (m *Mounter) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	return m.runWith(ctx, nil, name, args...)
}

// runWith runs a tool with files as its descriptors 3, 4, ...
func (m *Mounter) runWith(ctx context.Context, files []*os.File, name string, args ...string) ([]byte, error) {
	logger := klog.FromContext(ctx)
	start := time.Now()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.ExtraFiles = files
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	logger.V(4).Info("ran", "cmd", name, "args", args, "took", time.Since(start).Round(time.Millisecond), "err", err)
	if err != nil {
		return out.Bytes(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.Bytes(), nil
}

// DiskFormat returns what blkid finds on dev: a filesystem type, "" for a
// blank disk, or a description for something else (a partition table, RAID
// member, ...) so that such a disk is never formatted.
func (m *Mounter) DiskFormat(ctx context.Context, dev string) (string, error) {
	// -p probes the device itself, not the blkid cache, so a filesystem
	// written elsewhere (another node) is seen.
	cmd := exec.CommandContext(ctx, "blkid", "-p", "-s", "TYPE", "-s", "PTTYPE", "-o", "export", "--", dev)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 2 {
		return "", nil // nothing recognised: blank
	}
	if err != nil {
		return "", fmt.Errorf("blkid %s: %w: %s", dev, err, strings.TrimSpace(out.String()))
	}
	var fsType, ptType string
	for _, line := range strings.Split(out.String(), "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok {
			continue
		}
		switch k {
		case "TYPE":
			fsType = v
		case "PTTYPE":
			ptType = v
		}
	}
	if ptType != "" {
		return "partition table " + ptType, nil
	}
	if fsType == "" {
		return "unrecognised data", nil
	}
	return fsType, nil
}

// FormatAndMount mounts dev at target with fsType (DefaultFSType when empty),
// first creating the filesystem if and only if the disk is blank. A disk that
// holds anything is never reformatted; with fsType empty its existing
// filesystem is mounted whatever it is. formatted reports whether mkfs ran.
func (m *Mounter) FormatAndMount(ctx context.Context, dev, target, fsType string, options []string) (formatted bool, err error) {
	logger := klog.FromContext(ctx)
	// A target that cannot be mounted on (a symlink) fails before the disk
	// is touched.
	if err := EnsureDir(target); err != nil {
		return false, err
	}
	have, err := m.DiskFormat(ctx, dev)
	if err != nil {
		return false, err
	}
	want := fsType
	switch {
	case have == "":
		if want == "" {
			want = DefaultFSType
		}
		if hasOption(options, "ro") {
			return false, fmt.Errorf("%s is blank and cannot be formatted for a read-only mount", dev)
		}
		if err := m.format(ctx, dev, want); err != nil {
			return false, err
		}
		formatted = true
		logger.Info("formatted blank disk", "device", dev, "fsType", want)
	case want == "":
		if !SupportedFSType(have) {
			return false, &MismatchError{Device: dev, Want: DefaultFSType + " (or another filesystem)", Have: have}
		}
		want = have
	case want != have:
		return false, &MismatchError{Device: dev, Want: want, Have: have}
	}
	if !formatted && !hasOption(options, "ro") {
		if err := m.checkFilesystem(ctx, dev, want); err != nil {
			return false, err
		}
	}
	if err := m.Mount(ctx, dev, target, want, options); err != nil {
		if !formatted && want == "xfs" {
			return false, m.explainXFSMountFailure(ctx, dev, err)
		}
		return formatted, err
	}
	return formatted, nil
}

func (m *Mounter) format(ctx context.Context, dev, fsType string) error {
	var args []string
	switch fsType {
	case "ext4", "ext3":
		// -m0: a volume's space belongs to its user, not to root reserves.
		// -F is not given: mke2fs then still refuses some unsafe targets.
		args = []string{"-m0", "--", dev}
	case "xfs":
		// No -f: mkfs.xfs refuses to overwrite a signature it recognises,
		// a second guard after blkid.
		args = []string{"--", dev}
	default:
		return fmt.Errorf("unsupported filesystem type %q", fsType)
	}
	_, err := m.run(ctx, "mkfs."+fsType, args...)
	return err
}

// Mount mounts the device source at target, a directory it creates if
// missing and never a symlink.
func (m *Mounter) Mount(ctx context.Context, source, target, fsType string, options []string) error {
	if err := EnsureDir(target); err != nil {
		return err
	}
	t, err := openPath(target, unix.S_IFDIR)
	if err != nil {
		return err
	}
	defer func() { _ = t.Close() }()
	args := []string{"--no-canonicalize"}
	if fsType != "" {
		args = append(args, "-t", fsType)
	}
	if len(options) > 0 {
		args = append(args, "-o", strings.Join(options, ","))
	}
	args = append(args, "--", source, fdPath(0))
	if _, err := m.runWith(ctx, []*os.File{t}, "mount", args...); err != nil {
		return fmt.Errorf("mount %s at %s: %w", source, target, err)
	}
	return m.checkMounted(target)
}

// fdPath names the i-th of runWith's files in the child.
func fdPath(i int) string { return "/proc/self/fd/" + strconv.Itoa(3+i) }

// openPath opens path itself for reference only (O_PATH), refusing a symlink
// there, and checks it is of the wanted type (unix.S_IFDIR, unix.S_IFREG;
// 0 for any but a link).
func openPath(path string, want uint32) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		_ = unix.Close(fd)
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	switch typ := st.Mode & unix.S_IFMT; {
	case typ == unix.S_IFLNK:
		_ = unix.Close(fd)
		return nil, &SymlinkError{Path: path}
	case want != 0 && typ != want:
		_ = unix.Close(fd)
		return nil, fmt.Errorf("%s is not a %s", path, typeName(want))
	}
	return os.NewFile(uintptr(fd), path), nil
}

func typeName(t uint32) string {
	switch t {
	case unix.S_IFDIR:
		return "directory"
	case unix.S_IFREG:
		return "regular file"
	case unix.S_IFBLK:
		return "block device"
	}
	return "file of the expected type"
}

// checkMounted confirms the mount just made is at the path itself: the
// descriptor pins one directory, and if the path was swapped meanwhile the
// mount is elsewhere.
func (m *Mounter) checkMounted(target string) error {
	if ok, err := m.IsMountPoint(target); err != nil || ok {
		return err
	}
	return fmt.Errorf("%s is not a mount point after mounting on it: the path changed during the mount", target)
}

// EnsureDir creates path as a directory (with its parents) unless it is one;
// a symlink there is an error, never followed.
func EnsureDir(path string) error {
	st, err := os.Lstat(path)
	switch {
	case os.IsNotExist(err):
		return os.MkdirAll(path, 0o750)
	case err != nil:
		return err
	case st.Mode()&os.ModeSymlink != 0:
		return &SymlinkError{Path: path}
	case !st.IsDir():
		return fmt.Errorf("%s exists and is not a directory", path)
	}
	return nil
}

// bindRemountable are the per-mount flags a bind mount can carry; filesystem
// options (discard, data=...) belong to the staging mount only.
var bindRemountable = map[string]bool{
	"ro": true, "rw": true, "nosuid": true, "suid": true, "nodev": true, "dev": true,
	"noexec": true, "exec": true, "noatime": true, "atime": true, "nodiratime": true,
	"diratime": true, "relatime": true, "norelatime": true, "strictatime": true, "nosymfollow": true,
}

// BindMount bind-mounts source (a directory or a device node) onto target,
// which must exist, and applies readOnly and the per-mount flags in options.
// The flags need a second "remount,bind" because the kernel ignores them on
// the initial bind. Neither path may be a symlink.
func (m *Mounter) BindMount(ctx context.Context, source, target string, readOnly bool, options []string) error {
	src, err := openPath(source, 0)
	if err != nil {
		return err
	}
	defer func() { _ = src.Close() }()
	tgt, err := openPath(target, 0)
	if err != nil {
		return err
	}
	defer func() { _ = tgt.Close() }()
	if _, err := m.runWith(ctx, []*os.File{tgt, src}, "mount", "--no-canonicalize", "--bind", "--", fdPath(1), fdPath(0)); err != nil {
		return fmt.Errorf("bind %s onto %s: %w", source, target, err)
	}
	if err := m.checkMounted(target); err != nil {
		return err
	}
	var flags []string
	for _, o := range options {
		if bindRemountable[o] && o != "ro" && o != "rw" {
			flags = append(flags, o)
		}
	}
	if readOnly {
		flags = append(flags, "ro")
	}
	if len(flags) == 0 {
		return nil
	}
	// Open again: the first descriptor is the directory under the new mount,
	// and a remount must name the mount's root.
	top, err := openPath(target, 0)
	if err == nil {
		defer func() { _ = top.Close() }()
		_, err = m.runWith(ctx, []*os.File{top}, "mount", "--no-canonicalize", "-o", "remount,bind,"+strings.Join(flags, ","), "--", fdPath(0))
	}
	if err != nil {
		// Leave nothing half-done: a writable bind where read-only was asked
		// for must not survive.
		_ = unix.Unmount(target, unix.UMOUNT_NOFOLLOW)
		return fmt.Errorf("apply %s to the bind at %s: %w", strings.Join(flags, ","), target, err)
	}
	return nil
}

// IsMountPoint reports whether something is mounted exactly at path. A path
// that does not exist, or is a symlink, is not a mount point.
func (m *Mounter) IsMountPoint(path string) (bool, error) {
	_, ok, err := m.MountAt(path)
	return ok, err
}

// MountAt returns the mount at exactly path, if any; a symlink at path is
// not followed (see mountinfo.At).
func (m *Mounter) MountAt(path string) (mountinfo.Mount, bool, error) {
	mounts, err := mountinfo.Read(m.mountInfo)
	if err != nil {
		return mountinfo.Mount{}, false, err
	}
	mnt, ok := mountinfo.At(mounts, path)
	return mnt, ok, nil
}

// Mounts returns the current mount table.
func (m *Mounter) Mounts() ([]mountinfo.Mount, error) { return mountinfo.Read(m.mountInfo) }

// Unmount unmounts path until it is no longer a mount point (several mounts
// can be stacked on one path after retries of a publish). A path that is
// not mounted, or does not exist, is fine.
func (m *Mounter) Unmount(ctx context.Context, path string) error {
	return m.unmountAll(ctx, path, 0)
}

// LazyUnmount detaches the mount at path now and lets the kernel finish once
// nothing uses it. It is for mounts whose device is gone, where a normal
// unmount can hang or fail on I/O errors.
func (m *Mounter) LazyUnmount(ctx context.Context, path string) error {
	return m.unmountAll(ctx, path, unix.MNT_DETACH)
}

func (m *Mounter) unmountAll(ctx context.Context, path string, flags int) error {
	for range m.unmountAttempts {
		mounted, err := m.IsMountPoint(path)
		if err != nil {
			return err
		}
		if !mounted {
			return nil
		}
		if err := unmountOnce(ctx, path, flags); err != nil {
			return err
		}
	}
	return fmt.Errorf("%s is still a mount point after %d unmounts", path, m.unmountAttempts)
}

// unmountOnce removes the topmost mount at path; one that is already gone
// (EINVAL: not a mount point any more, ENOENT: no path) is not an error. A
// symlink at path is not followed, so it never unmounts the link's
// destination.
func unmountOnce(ctx context.Context, path string, flags int) error {
	what := "unmount"
	if flags&unix.MNT_DETACH != 0 {
		what = "lazy unmount"
	}
	if err := unix.Unmount(path, flags|unix.UMOUNT_NOFOLLOW); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("%s %s: %w", what, path, err)
	}
	klog.FromContext(ctx).V(2).Info(what+" done", "path", path)
	return nil
}

// Detach lazily unmounts the topmost mount at path once (see LazyUnmount),
// for callers that check what they unmount between steps.
func (m *Mounter) Detach(ctx context.Context, path string) error {
	return unmountOnce(ctx, path, unix.MNT_DETACH)
}

// RemovePath removes a target path left by publish: an empty directory or
// the file a block device was bound onto. It refuses to remove a mount point
// or a non-empty directory, so data can never be deleted by accident.
func (m *Mounter) RemovePath(path string) error {
	mounted, err := m.IsMountPoint(path)
	if err != nil {
		return err
	}
	if mounted {
		return fmt.Errorf("%s is still a mount point", path)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return err
	}
	return nil
}

// Resize grows the filesystem on dev, mounted at mountPath, to fill the
// device. ext* grow online through the device, xfs through the mount point.
func (m *Mounter) Resize(ctx context.Context, dev, mountPath string) error {
	fsType, err := m.DiskFormat(ctx, dev)
	if err != nil {
		return err
	}
	switch fsType {
	case "ext4", "ext3", "ext2":
		_, err = m.run(ctx, "resize2fs", "--", dev)
	case "xfs":
		_, err = m.run(ctx, "xfs_growfs", "-d", "--", mountPath)
	default:
		err = fmt.Errorf("cannot grow %q on %s", fsType, dev)
	}
	if err == nil {
		klog.FromContext(ctx).Info("grew filesystem", "device", dev, "fsType", fsType, "path", mountPath)
	}
	return err
}

// Stats is what statfs says about a mounted filesystem.
type Stats struct {
	TotalBytes, AvailableBytes, UsedBytes int64
	TotalInodes, FreeInodes, UsedInodes   int64
}

// FSStats returns usage of the filesystem at path, which must not be a
// symlink.
func FSStats(path string) (Stats, error) {
	f, err := openPath(path, 0)
	if err != nil {
		return Stats{}, err
	}
	defer func() { _ = f.Close() }()
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err != nil {
		return Stats{}, &os.PathError{Op: "statfs", Path: path, Err: err}
	}
	bs := st.Bsize
	s := Stats{
		TotalBytes:     int64(st.Blocks) * bs,
		AvailableBytes: int64(st.Bavail) * bs,
		UsedBytes:      int64(st.Blocks-st.Bfree) * bs,
		TotalInodes:    int64(st.Files),
		FreeInodes:     int64(st.Ffree),
	}
	s.UsedInodes = s.TotalInodes - s.FreeInodes
	return s, nil
}

// DeviceSize returns the size in bytes of the block device at path (not
// through a symlink), asked from the device itself.
func DeviceSize(path string) (int64, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return 0, &SymlinkError{Path: path}
		}
		return 0, err
	}
	defer func() { _ = f.Close() }()
	var size uint64
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&size))); errno != 0 {
		return 0, fmt.Errorf("BLKGETSIZE64 %s: %w", path, errno)
	}
	return int64(size), nil
}

// EnsureFile creates path as an empty regular file (the target of a
// block-device bind mount) with its parent directories; a symlink at path is
// an error, never followed.
func EnsureFile(path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY|unix.O_NOFOLLOW, 0o640)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return &SymlinkError{Path: path}
		}
		return err
	}
	return f.Close()
}

func hasOption(options []string, o string) bool {
	for _, x := range options {
		if x == o {
			return true
		}
	}
	return false
}
