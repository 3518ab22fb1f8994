package loopdisk

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"k8s.io/klog/v2"
)

// snapshotExt ends snapshot file names; claims' files end in ".img", so the
// two never collide.
const snapshotExt = ".snap"

// SnapshotFile is the file that keeps snapshot, in BackingDir. Snapshot names
// ("namespace/name" from the simulator) may hold any character and be longer
// than a file name may be, so the file is keyed by a hash of the name, after
// a readable (sanitised, shortened) copy of it.
func (l *LoopDisks) SnapshotFile(snapshot string) string {
	sum := sha256.Sum256([]byte(snapshot))
	readable := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '.':
			return r
		}
		return '_'
	}, snapshot)
	if len(readable) > 64 {
		readable = readable[:64]
	}
	return filepath.Join(l.o.BackingDir, readable+"-"+hex.EncodeToString(sum[:16])+snapshotExt)
}

// Snapshot copies claimName's backing file to snapshot's file, replacing an
// earlier one of that name. A claim never plugged has no backing file yet and
// snapshots as an empty disk (a zero-length file; Plug sizes what is restored
// from it). Data the guest wrote to a plugged disk is in the snapshot once the
// guest has flushed it (fsync), as with a real crash-consistent snapshot.
func (l *LoopDisks) Snapshot(ctx context.Context, claimName, snapshot string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	src, dst := l.BackingFile(claimName), l.SnapshotFile(snapshot)
	var err error
	if _, serr := os.Stat(src); errors.Is(serr, os.ErrNotExist) {
		err = sparseCopy(ctx, "", dst)
	} else {
		err = sparseCopy(ctx, src, dst)
	}
	if err != nil {
		return fmt.Errorf("snapshot %s of %s: %w", snapshot, claimName, err)
	}
	klog.FromContext(ctx).Info("disk snapshotted", "claim", claimName, "snapshot", snapshot, "file", dst)
	return nil
}

// Restore replaces claimName's backing file with a copy of snapshot's. The
// claim must not be plugged (a loop device would keep the old file); Plug
// then grows the file to the claim's size if that is larger.
func (l *LoopDisks) Restore(ctx context.Context, snapshot, claimName string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	src, dst := l.SnapshotFile(snapshot), l.BackingFile(claimName)
	if _, err := os.Stat(src); err != nil {
		return fmt.Errorf("restore %s: %w", snapshot, err)
	}
	if _, err := os.Stat(dst); err == nil {
		out, err := run(ctx, "losetup", "--noheadings", "--output", "NAME", "--associated", dst)
		if err != nil {
			return err
		}
		if devs := strings.Fields(out); len(devs) > 0 {
			return fmt.Errorf("restore %s: claim %s is plugged (%s)", snapshot, claimName, strings.Join(devs, " "))
		}
	}
	if err := sparseCopy(ctx, src, dst); err != nil {
		return fmt.Errorf("restore %s to %s: %w", snapshot, claimName, err)
	}
	klog.FromContext(ctx).Info("disk restored", "claim", claimName, "snapshot", snapshot)
	return nil
}

// DeleteSnapshot removes snapshot's file; a missing one is not an error.
func (l *LoopDisks) DeleteSnapshot(ctx context.Context, snapshot string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := os.Remove(l.SnapshotFile(snapshot)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	klog.FromContext(ctx).Info("snapshot deleted", "snapshot", snapshot)
	return nil
}

// removeSnapshots removes every snapshot file, and copies left half-done.
func (l *LoopDisks) removeSnapshots() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	entries, err := os.ReadDir(l.o.BackingDir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	var errs []error
	for _, e := range entries {
		if n := e.Name(); strings.HasSuffix(n, snapshotExt) || strings.HasPrefix(n, tmpPrefix) {
			if err := os.Remove(filepath.Join(l.o.BackingDir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// tmpPrefix starts the name of a copy in progress, renamed over its target
// when complete, so a failed or cancelled copy never leaves a torn file.
const tmpPrefix = ".copy-"

// copyBlock is the granularity of hole detection: an all-zero block is not
// written, so it stays a hole in the copy.
const copyBlock = 64 << 10

// sparseCopy copies src to dst keeping holes: it reads only the data extents
// (SEEK_DATA/SEEK_HOLE, or the whole file where the filesystem has none) and
// skips zero blocks within them. An empty src makes an empty dst.
func sparseCopy(ctx context.Context, src, dst string) (err error) {
	out, err := os.CreateTemp(filepath.Dir(dst), tmpPrefix+"*")
	if err != nil {
		return err
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(out.Name())
		} else {
			err = os.Rename(out.Name(), dst)
		}
	}()
	if src == "" {
		return nil
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	st, err := in.Stat()
	if err != nil {
		return err
	}
	size := st.Size()
	buf := make([]byte, 16*copyBlock)
	for off := int64(0); off < size; {
		data, hole, err := nextExtent(in, off, size)
		if err != nil {
			return err
		}
		if data >= size {
			break
		}
		for p := data; p < hole; {
			if err := ctx.Err(); err != nil {
				return err
			}
			n := int(min(int64(len(buf)), hole-p))
			if _, err := in.ReadAt(buf[:n], p); err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			for b := 0; b < n; b += copyBlock {
				chunk := buf[b:min(b+copyBlock, n)]
				if isZero(chunk) {
					continue
				}
				if _, err := out.WriteAt(chunk, p+int64(b)); err != nil {
					return err
				}
			}
			p += int64(n)
		}
		off = hole
	}
	return out.Truncate(size)
}

// nextExtent returns the data extent [data, hole) at or after off; data is
// size when only a hole remains. Filesystems without SEEK_DATA report the
// rest of the file as data.
func nextExtent(f *os.File, off, size int64) (data, hole int64, err error) {
	data, err = f.Seek(off, seekData)
	switch {
	case errors.Is(err, syscall.ENXIO):
		return size, size, nil
	case errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.EOPNOTSUPP):
		return off, size, nil
	case err != nil:
		return 0, 0, err
	}
	if hole, err = f.Seek(data, seekHole); err != nil {
		return data, size, nil //nolint:nilerr // no hole information: copy the rest
	}
	return data, min(hole, size), nil
}

// lseek whence values of Linux (not in package syscall).
const (
	seekData = 3
	seekHole = 4
)

var zeroBlock = make([]byte, copyBlock)

func isZero(b []byte) bool { return bytes.Equal(b, zeroBlock[:len(b)]) }

// Clone replaces claimName's backing file with a copy of sourceClaim's, as
// Longhorn clones a volume: the source may be plugged and in use (data the
// guest has flushed is in the clone), the clone must not be (a loop device
// would keep the old file). A source never plugged clones as an empty disk.
func (l *LoopDisks) Clone(ctx context.Context, sourceClaim, claimName string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	src, dst := l.BackingFile(sourceClaim), l.BackingFile(claimName)
	if err := l.unplugged(ctx, dst); err != nil {
		return fmt.Errorf("clone %s to %s: %w", sourceClaim, claimName, err)
	}
	if _, err := os.Stat(src); errors.Is(err, os.ErrNotExist) {
		src = ""
	}
	if err := sparseCopy(ctx, src, dst); err != nil {
		return fmt.Errorf("clone %s to %s: %w", sourceClaim, claimName, err)
	}
	klog.FromContext(ctx).Info("disk cloned", "claim", claimName, "source", sourceClaim)
	return nil
}

// unplugged fails when a loop device holds file.
func (l *LoopDisks) unplugged(ctx context.Context, file string) error {
	if _, err := os.Stat(file); err != nil {
		return nil //nolint:nilerr // no file, no loop device
	}
	out, err := run(ctx, "losetup", "--noheadings", "--output", "NAME", "--associated", file)
	if err != nil {
		return err
	}
	if devs := strings.Fields(out); len(devs) > 0 {
		return fmt.Errorf("%s is plugged (%s)", filepath.Base(file), strings.Join(devs, " "))
	}
	return nil
}
