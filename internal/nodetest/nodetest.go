// Package nodetest supports tests that use real loop devices, filesystems
// and mounts: a TestMain wrapper that fails the package when a test leaves a
// loop device or a mount behind, and a skip for machines where such tests
// cannot run.
package nodetest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// Main runs the package's tests with TMPDIR pointed at a fresh directory, so
// every t.TempDir() lives under it, and then checks that no mount and no loop
// device under that directory survived. Other processes' loop devices and
// mounts (other packages testing in parallel) are not counted.
func Main(m *testing.M) {
	root, err := os.MkdirTemp("", "hcsi-node-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "nodetest:", err)
		os.Exit(2)
	}
	if r, err := filepath.EvalSymlinks(root); err == nil {
		root = r
	}
	_ = os.Setenv("TMPDIR", root)
	code := m.Run()
	if leaks := waitNoLeaks(root, patience); len(leaks) > 0 {
		fmt.Fprintf(os.Stderr, "nodetest: the tests left these behind:\n  %s\n", strings.Join(leaks, "\n  "))
		if code == 0 {
			code = 1
		}
	} else {
		_ = os.RemoveAll(root)
	}
	os.Exit(code)
}

// patience bounds every wait for observable state in node tests. It is
// generous on purpose: a wait ends as soon as the state is there, and on a
// machine running two test suites at once a lazily unmounted filesystem can
// take many seconds to let its loop device go.
const patience = 2 * time.Minute

// Eventually polls cond until it holds, failing t with what after patience.
// Tests wait this way for state they can observe (a loop device released, a
// mount gone), never for a fixed time.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testwait.For(t, what, patience, cond)
}

// waitNoLeaks polls: a loop device with autoclear is released by the kernel
// only after its last user goes.
func waitNoLeaks(root string, wait time.Duration) []string {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	var leaks []string
	_ = testwait.Poll(ctx, "no leaks under "+root, func() (bool, string, error) {
		leaks = Leaks(root)
		return len(leaks) == 0, "", nil
	})
	return leaks
}

// Leaks lists mounts below root and loop devices backed by files below root.
func Leaks(root string) []string {
	var out []string
	f, err := os.Open("/proc/self/mountinfo")
	if err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) > 4 && (fields[4] == root || strings.HasPrefix(fields[4], root+"/")) {
				out = append(out, "mount "+fields[4])
			}
		}
		_ = f.Close()
	}
	if b, err := exec.Command("losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE").Output(); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, root+"/") {
				out = append(out, "loop device "+strings.Join(strings.Fields(line), " "))
			}
		}
	}
	return out
}

// RequireRealDevices skips t unless loop devices, filesystems and mounts can
// be used: root, losetup and the named tools (mkfs.ext4 is always needed).
func RequireRealDevices(t testing.TB, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the test uses real loop devices, filesystems and mounts (CI runs it as root)")
	}
	for _, tool := range append([]string{"losetup", "mkfs.ext4", "blkid", "mount"}, tools...) {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (`make os-deps` as root installs util-linux, mount, e2fsprogs and xfsprogs): %v", tool, err)
		}
	}
}

// Run runs a command for a test and returns its combined output.
func Run(t testing.TB, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// Checksum returns the SHA-256 of a file's content.
func Checksum(t testing.TB, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// WriteRandom writes n pseudo-random bytes to path and fsyncs it.
func WriteRandom(t testing.TB, path string, n int, seed byte) {
	t.Helper()
	buf := make([]byte, n)
	x := uint32(seed) + 1
	for i := range buf {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		buf[i] = byte(x)
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(f, bytes.NewReader(buf)); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// CleanupMounts registers a cleanup that lazily unmounts everything still
// mounted at or below dir, so a failing test neither leaks mounts nor lets
// t.TempDir's removal descend into a mounted filesystem. Register it after
// creating dir (cleanups run last-in first-out).
func CleanupMounts(t testing.TB, dir string) {
	t.Helper()
	t.Cleanup(func() {
		for i := 0; i < 20; i++ {
			mps := mountsBelow(dir)
			if len(mps) == 0 {
				return
			}
			for _, mp := range mps {
				_ = exec.Command("umount", "-l", mp).Run()
			}
		}
	})
}

func mountsBelow(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		fields := strings.Fields(line)
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			out = append(out, fields[4])
		}
	}
	// Deepest first.
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out
}

// CapSysResource is the capability ext4 online resize needs.
const CapSysResource = 24

// HasCapability reports whether this process has capability bit c in its
// effective set. Sandboxes that drop CAP_SYS_RESOURCE cannot grow a mounted
// ext4 filesystem (EXT4_IOC_RESIZE_FS returns EPERM).
func HasCapability(c uint) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			var caps uint64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%x", &caps); err != nil {
				return false
			}
			return caps&(1<<c) != 0
		}
	}
	return false
}
