package device

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
)

// Holder is something that keeps a device busy: a process (PID > 0) or a
// mount (PID 0).
type Holder struct {
	PID     int
	Command string
	// What says how it holds the device, e.g. "fd 3", "cwd", "mapped file",
	// "mounted at /var/lib/kubelet/...".
	What string
}

func (h Holder) key() string { return strconv.Itoa(h.PID) + "\x00" + h.What }

func (h Holder) String() string {
	if h.PID == 0 {
		return h.What
	}
	return fmt.Sprintf("pid %d (%s) %s", h.PID, h.Command, h.What)
}

// InUseError names what keeps a device busy.
type InUseError struct {
	Device  Device
	Holders []Holder
}

func (e *InUseError) Error() string {
	parts := make([]string, 0, len(e.Holders))
	for _, h := range e.Holders {
		parts = append(parts, h.String())
	}
	return fmt.Sprintf("device %s is in use: %s", e.Device.Path, strings.Join(parts, "; "))
}

// InUseOptions configures an InUseChecker.
type InUseOptions struct {
	// ProcRoot is where procfs is mounted (default /proc); with hostPID it
	// shows every process on the node.
	ProcRoot string
	// MountInfoPath is the mount table to inspect (default /proc/self/mountinfo).
	MountInfoPath string
	// SelfPID is ignored: the driver opens devices itself for a moment (blkid,
	// size ioctls) and must not report itself (default os.Getpid()).
	SelfPID int
	// Rechecks is how many times a holder is looked for again before it counts
	// (default 2): short-lived opens, e.g. by udev or blkid, go away.
	Rechecks int
	// RecheckInterval is the delay between checks (default 500ms).
	RecheckInterval time.Duration
}

// InUseChecker finds processes and mounts that hold a device.
type InUseChecker struct {
	procRoot  string
	mountInfo string
	self      int
	rechecks  int
	interval  time.Duration
}

// NewInUseChecker returns a checker with defaults applied.
func NewInUseChecker(o InUseOptions) *InUseChecker {
	c := &InUseChecker{procRoot: o.ProcRoot, mountInfo: o.MountInfoPath, self: o.SelfPID, rechecks: o.Rechecks, interval: o.RecheckInterval}
	if c.procRoot == "" {
		c.procRoot = "/proc"
	}
	if c.mountInfo == "" {
		c.mountInfo = filepath.Join(c.procRoot, "self", "mountinfo")
	}
	if c.self == 0 {
		c.self = os.Getpid()
	}
	if c.rechecks <= 0 {
		c.rechecks = 2
	}
	if c.interval <= 0 {
		c.interval = 500 * time.Millisecond
	}
	return c
}

// Check returns nil when nothing but the mounts at allowedMounts holds d, and
// an *InUseError otherwise. A holder must be seen again after each recheck
// interval before it counts, so a transient open does not fail the caller.
func (c *InUseChecker) Check(ctx context.Context, d Device, allowedMounts ...string) error {
	logger := klog.FromContext(ctx)
	prev, err := c.Scan(ctx, d, allowedMounts...)
	if err != nil || len(prev) == 0 {
		return err
	}
	for i := 0; i < c.rechecks; i++ {
		logger.V(2).Info("device looks busy, checking again", "device", d.Path, "holders", holderStrings(prev), "in", c.interval)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(c.interval):
		}
		cur, err := c.Scan(ctx, d, allowedMounts...)
		if err != nil {
			return err
		}
		if len(cur) == 0 {
			logger.V(2).Info("device holders were transient", "device", d.Path, "holders", holderStrings(prev))
			return nil
		}
		stable := intersect(prev, cur)
		if len(stable) == 0 {
			// Different holders each time: keep looking at the newest ones.
			stable = cur
		}
		prev = stable
	}
	return &InUseError{Device: d, Holders: prev}
}

func holderStrings(hs []Holder) []string {
	out := make([]string, 0, len(hs))
	for _, h := range hs {
		out = append(out, h.String())
	}
	return out
}

func intersect(a, b []Holder) []Holder {
	seen := map[string]bool{}
	for _, h := range a {
		seen[h.key()] = true
	}
	var out []Holder
	for _, h := range b {
		if seen[h.key()] {
			out = append(out, h)
		}
	}
	return out
}

// Scan looks once for holders of d: open file descriptors, working and root
// directories and memory maps of every process but ours that refer to the
// device node or to a file on its filesystem, and mounts of it other than
// allowedMounts.
func (c *InUseChecker) Scan(ctx context.Context, d Device, allowedMounts ...string) ([]Holder, error) {
	var out []Holder
	mounts, err := mountinfo.Read(c.mountInfo)
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	allowed := map[string]bool{}
	for _, p := range allowedMounts {
		allowed[mountinfo.Canonical(p)] = true
	}
	base := filepath.Base(d.Path)
	for _, m := range mounts {
		if allowed[m.MountPoint] {
			continue
		}
		if m.Major == d.Major && m.Minor == d.Minor {
			out = append(out, Holder{What: "mounted at " + m.MountPoint})
			continue
		}
		// A bind mount of the device node itself (block-mode publish) has the
		// node's name as its root; only those are worth a stat.
		if filepath.Base(m.Root) == base {
			if o, err := FromPath(m.MountPoint); err == nil && o.Same(d) {
				out = append(out, Holder{What: "bind-mounted at " + m.MountPoint})
			}
		}
	}

	procs, err := os.ReadDir(c.procRoot)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", c.procRoot, err)
	}
	rdev := unix.Mkdev(d.Major, d.Minor)
	for _, p := range procs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == c.self {
			continue
		}
		out = append(out, c.scanProcess(pid, rdev, d)...)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].key() < out[j].key() })
	return out, nil
}

// scanProcess ignores errors: processes come and go while we look, and a
// process we cannot inspect cannot be named anyway.
func (c *InUseChecker) scanProcess(pid int, rdev uint64, d Device) []Holder {
	dir := filepath.Join(c.procRoot, strconv.Itoa(pid))
	var found []string
	refers := func(path string) bool {
		var st unix.Stat_t
		if unix.Stat(path, &st) != nil {
			return false
		}
		if st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == rdev {
			return true // the device node itself
		}
		return st.Dev == rdev // a file on its filesystem
	}
	if fds, err := os.ReadDir(filepath.Join(dir, "fd")); err == nil {
		for _, fd := range fds {
			if refers(filepath.Join(dir, "fd", fd.Name())) {
				found = append(found, "fd "+fd.Name())
			}
		}
	}
	for _, link := range []string{"cwd", "root"} {
		if refers(filepath.Join(dir, link)) {
			found = append(found, link)
		}
	}
	if mapsRefer(filepath.Join(dir, "maps"), d) {
		found = append(found, "mapped file")
	}
	if len(found) == 0 {
		return nil
	}
	comm, _ := os.ReadFile(filepath.Join(dir, "comm"))
	cmd := strings.TrimSpace(string(comm))
	out := make([]Holder, 0, len(found))
	for _, w := range found {
		out = append(out, Holder{PID: pid, Command: cmd, What: w})
	}
	return out
}

// mapsRefer reports whether a maps file has a mapping of a file on d; the
// fourth field is the backing device as hex "major:minor".
func mapsRefer(path string, d Device) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer func() { _ = f.Close() }()
	want := fmt.Sprintf("%02x:%02x", d.Major, d.Minor)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 5 && fields[3] == want && fields[4] != "0" {
			return true
		}
	}
	return false
}
