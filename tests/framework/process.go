package framework

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/proc"
)

// DriverPackage is the driver's main package.
const DriverPackage = "github.com/harvester-csi/harvester-csi-driver/cmd/harvester-csi-driver"

// BuildDriver builds the driver binary into dir and returns its path.
func BuildDriver(tb testing.TB, dir string) string {
	tb.Helper()
	bin := filepath.Join(dir, "harvester-csi-driver")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := proc.Build(ctx, bin, DriverPackage); err != nil {
		tb.Fatalf("build the driver: %v", err)
	}
	return bin
}

// StartProcess runs spec (internal/proc) with its output in
// <logDir>/<spec.Name>.log, a new log each time. When tb ends it is stopped
// as kubelet stops a container (SIGTERM, SIGKILL after 10 s) and, if tb
// failed, its log is shown.
func StartProcess(tb testing.TB, logDir string, spec proc.Spec) *proc.Proc {
	tb.Helper()
	g, err := proc.NewGroup(context.Background(), logDir)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.Remove(g.LogPath(spec.Name)); err != nil && !os.IsNotExist(err) {
		tb.Fatal(err)
	}
	p, err := g.Start(spec)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		g.Stop(10 * time.Second)
		if tb.Failed() {
			logTail(tb, g.LogPath(spec.Name))
		}
	})
	return p
}

// logTail shows the end of a process's log: what it did last is what
// explains a failure, and a long run's whole log would bury the test's own
// messages.
func logTail(tb testing.TB, path string) {
	const tail = 64 << 10
	b, err := os.ReadFile(path)
	if err != nil {
		tb.Logf("log %s: %v", path, err)
		return
	}
	if len(b) > tail {
		tb.Logf("last %d KiB of %s:\n%s", tail>>10, path, b[len(b)-tail:])
		return
	}
	tb.Logf("%s:\n%s", path, b)
}
