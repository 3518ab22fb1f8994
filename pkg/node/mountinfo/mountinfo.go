// Package mountinfo parses /proc/<pid>/mountinfo. The node code needs the
// device number and root of each mount (to tell a staging mount from a bind of
// a device node, and to find which device backs a path), which /proc/mounts
// does not carry.
package mountinfo

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// SelfPath is the mount table of the calling process's mount namespace.
const SelfPath = "/proc/self/mountinfo"

// Mount is one line of a mountinfo file.
type Mount struct {
	ID, ParentID int
	// Major and Minor identify the filesystem's device (st_dev of files on it).
	Major, Minor uint32
	// Root is the path inside the filesystem that is mounted; for a bind mount
	// of /dev/loop3 out of devtmpfs it is "/loop3".
	Root       string
	MountPoint string
	Options    string
	FSType     string
	Source     string
	SuperOpts  string
}

// Read parses the mountinfo file at path (SelfPath when empty).
func Read(path string) ([]Mount, error) {
	if path == "" {
		path = SelfPath
	}
	// Read in one go: the kernel builds the file per read() call and a
	// line-by-line reader could observe a table that changes between chunks.
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(bytes.NewReader(data))
}

// Parse parses mountinfo content.
func Parse(r io.Reader) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			continue
		}
		m, err := parseLine(line)
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, sc.Err()
}

func parseLine(line string) (Mount, error) {
	// 36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
	fields := strings.Fields(line)
	sep := -1
	for i := 6; i < len(fields); i++ {
		if fields[i] == "-" {
			sep = i
			break
		}
	}
	if len(fields) < 7 || sep < 0 || len(fields) < sep+3 {
		return Mount{}, fmt.Errorf("malformed mountinfo line %q", line)
	}
	var m Mount
	var err error
	if m.ID, err = strconv.Atoi(fields[0]); err != nil {
		return Mount{}, fmt.Errorf("malformed mount id in %q", line)
	}
	if m.ParentID, err = strconv.Atoi(fields[1]); err != nil {
		return Mount{}, fmt.Errorf("malformed parent id in %q", line)
	}
	maj, min, ok := strings.Cut(fields[2], ":")
	if !ok {
		return Mount{}, fmt.Errorf("malformed device number in %q", line)
	}
	ma, err1 := strconv.ParseUint(maj, 10, 32)
	mi, err2 := strconv.ParseUint(min, 10, 32)
	if err1 != nil || err2 != nil {
		return Mount{}, fmt.Errorf("malformed device number in %q", line)
	}
	m.Major, m.Minor = uint32(ma), uint32(mi)
	m.Root = unescape(fields[3])
	m.MountPoint = unescape(fields[4])
	m.Options = fields[5]
	m.FSType = fields[sep+1]
	m.Source = unescape(fields[sep+2])
	if len(fields) > sep+3 {
		m.SuperOpts = fields[sep+3]
	}
	return m, nil
}

// unescape undoes the kernel's octal escaping of space, tab, newline and
// backslash in paths.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// At returns the mount visible at exactly path (the last one stacked there).
// Symlinks in path's parent directories are resolved, because the kernel
// records resolved mount points (a kubelet root may itself be a link), but
// a symlink as the last component is not: a link is never a mount point, and
// following it would make an unrelated mount look like the caller's.
func At(mounts []Mount, path string) (Mount, bool) {
	p := Canonical(path)
	for i := len(mounts) - 1; i >= 0; i-- {
		if mounts[i].MountPoint == p {
			return mounts[i], true
		}
	}
	return Mount{}, false
}

// Canonical cleans path and resolves symlinks in its parent directories where
// possible, so it can be compared with mount points from mountinfo. The last
// component is kept as it is (see At).
func Canonical(path string) string {
	p := filepath.Clean(path)
	dir, base := filepath.Split(p)
	if base == "" || dir == "" {
		return p // "/" or a relative single name
	}
	if r, err := filepath.EvalSymlinks(dir); err == nil {
		return filepath.Join(r, base)
	}
	return p
}

// OnDevice returns the mounts of the filesystem on device major:minor.
func OnDevice(mounts []Mount, major, minor uint32) []Mount {
	var out []Mount
	for _, m := range mounts {
		if m.Major == major && m.Minor == minor {
			out = append(out, m)
		}
	}
	return out
}
