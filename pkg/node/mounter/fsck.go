package mounter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// Exit status bits of e2fsck (e2fsck(8), "EXIT CODE"); they are or-ed.
const (
	fsckCorrected   = 1 // errors found and fixed
	fsckReboot      = 2 // fixed, and a mounted root would need a reboot
	fsckUncorrected = 4 // errors left: a person has to run it
)

// FilesystemError is returned for a filesystem that has errors the automatic
// check cannot repair (or, for XFS, that the kernel refuses to mount as
// corrupt). Nothing is mounted; retrying does not help until someone repairs
// the disk by hand.
type FilesystemError struct {
	Device, FSType string
	// Tool is what found the damage; Repair what an operator runs.
	Tool, Repair string
	Output       string
}

func (e *FilesystemError) Error() string {
	return fmt.Sprintf("the %s filesystem on %s has errors that cannot be repaired automatically (%s): %s; "+
		"it was not mounted: repair it by hand (%s) while nothing mounts it", e.FSType, e.Device, e.Tool, e.Output, e.Repair)
}

// checkFilesystem checks a filesystem before it is mounted read-write, as
// Kubernetes' own mount code does (k8s.io/mount-utils v0.35.4, the version
// tools/kubelet/go.mod builds the kubelet with, mount_linux.go,
// checkAndRepairFilesystem, called from formatAndMountSensitive for a disk
// that is already formatted and not mounted read-only). A disk comes here
// after a forced detach, an out-of-service fence or a VM that died, with its
// filesystem never unmounted: ext* are checked in preen mode, which replays
// the journal and fixes what is safe to fix, and refuses the rest. mount-utils
// runs `fsck -a`, which for ext* runs e2fsck with -a (the same as -p); e2fsck
// is called directly because util-linux fsck passes whatever follows "--" to
// the checker as options, and the device path must come after "--". XFS is
// not checked: fsck.xfs does nothing on purpose, since the kernel replays
// the XFS log when it mounts; a corrupt XFS is recognised when its mount
// fails (explainXFSMountFailure).
func (m *Mounter) checkFilesystem(ctx context.Context, dev, fsType string) error {
	switch fsType {
	case "ext4", "ext3", "ext2":
	default:
		return nil
	}
	logger := klog.FromContext(ctx)
	// A filesystem mounted elsewhere (a volume that upstream's driver mounted
	// straight onto a pod's target path) belongs to the kernel: checking it
	// could only fail, or worse.
	if mounted, err := m.deviceMounted(dev); err != nil || mounted {
		if mounted {
			logger.V(2).Info("filesystem already mounted elsewhere; not checked", "device", dev)
		}
		return err
	}
	cmd := exec.CommandContext(ctx, "e2fsck", "-p", "--", dev)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	output := strings.TrimSpace(out.String())
	var ee *exec.ExitError
	switch {
	case err == nil:
		logger.V(2).Info("filesystem checked", "device", dev, "fsType", fsType, "output", output)
		return nil
	case !errors.As(err, &ee) || ctx.Err() != nil:
		return fmt.Errorf("e2fsck -p %s: %w: %s", dev, err, output)
	case ee.ExitCode()&fsckUncorrected != 0:
		return &FilesystemError{Device: dev, FSType: fsType, Tool: fmt.Sprintf("e2fsck -p exit %d", ee.ExitCode()), Repair: "e2fsck -f", Output: output}
	case ee.ExitCode()&^(fsckCorrected|fsckReboot) == 0:
		logger.Info("filesystem had errors, repaired before mounting", "device", dev, "fsType", fsType, "output", output)
		return nil
	default:
		// 8 and above: e2fsck could not do its work (device busy, I/O
		// error). A filesystem that could not be checked is not mounted
		// read-write; the stage is retried.
		return fmt.Errorf("e2fsck -p %s could not check the filesystem (exit %d): %s", dev, ee.ExitCode(), output)
	}
}

// explainXFSMountFailure tells a corrupt XFS from any other reason its mount
// failed: the kernel refuses a corrupt one (EUCLEAN, "Structure needs
// cleaning"), whose wording depends on the mount(8) version, so xfs_repair
// in no-modify mode is asked instead; it exits 1 when it finds corruption.
func (m *Mounter) explainXFSMountFailure(ctx context.Context, dev string, mountErr error) error {
	_, err := m.run(ctx, "xfs_repair", "-n", "--", dev)
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 1 && ctx.Err() == nil {
		return &FilesystemError{Device: dev, FSType: "xfs", Tool: "the mount failed and xfs_repair -n found corruption",
			Repair: "xfs_repair", Output: mountErr.Error()}
	}
	return mountErr
}

// deviceMounted reports whether the block device at dev backs any mount.
func (m *Mounter) deviceMounted(dev string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return false, fmt.Errorf("stat %s: %w", dev, err)
	}
	mounts, err := m.Mounts()
	if err != nil {
		return false, err
	}
	for _, mnt := range mounts {
		if mnt.Major == unix.Major(st.Rdev) && mnt.Minor == unix.Minor(st.Rdev) {
			return true, nil
		}
	}
	return false, nil
}
