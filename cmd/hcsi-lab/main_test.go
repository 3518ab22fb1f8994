package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// The --quick lab, with NodeUnstageVolume skipped now and then and the
// controller process killed every 40 s, must pass: no invariant broken,
// nothing stuck, every data check good. It runs the built binaries as a user
// would (make lab LAB_FLAGS=--quick).
func TestQuickLab(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the lab needs root (loop devices, mounts, a mount namespace)")
	}
	if testing.Short() {
		t.Skip("runs the whole lab (a few minutes)")
	}
	work := t.TempDir()
	bin, driver, labBin := buildLab(t, work)
	out := filepath.Join(work, "run")

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, labBin, "--quick", "--driver-binary="+driver, "--out="+out)
	cmd.Env = append(os.Environ(), "HCSI_TOOLS_BIN="+bin)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stdout
	runErr := cmd.Run()
	t.Logf("hcsi-lab output:\n%s", stdout.String())

	data, err := os.ReadFile(filepath.Join(out, "report.json"))
	if err != nil {
		t.Fatalf("no report (lab exit: %v): %v", runErr, err)
	}
	var rep lab.Report
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatal(err)
	}
	if runErr != nil || !rep.Passed {
		for _, v := range rep.InvariantViolations {
			t.Errorf("violation: %s", v)
		}
		t.Fatalf("the quick lab failed (exit %v, outcome %s, stuck %d); logs in %s", runErr, rep.Outcome, rep.Stuck, filepath.Join(out, "logs"))
	}
	// The run must have exercised what it claims to.
	if rep.Operations.JobsRun == 0 || rep.Operations.Attaches == 0 || rep.Operations.Detaches == 0 || rep.Operations.DatabaseMoves == 0 {
		t.Errorf("the workload did not run: %+v", rep.Operations)
	}
	if rep.DataChecks.Passed == 0 {
		t.Error("no data check ran")
	}
	if rep.NodeCalls.UnstageSkipped == 0 {
		t.Error("the skip-unstage fault never struck")
	}
	if rep.Driver.Restarts == 0 {
		t.Error("the controller-kill fault never struck")
	}
	for _, f := range []string{"summary.txt", "latency.svg", "logs/driver-controller.log", "logs/kubelet-node-0.log"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("run directory lacks %s", f)
		}
	}
	// Nothing of the run is left on the machine.
	if loops, _ := exec.Command("losetup", "--noheadings", "--output", "BACK-FILE", "--list").Output(); strings.Contains(string(loops), out) {
		t.Errorf("loop devices left on the run's disks:\n%s", loops)
	}
	if mounts, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mounts), "hcsi-lab-") {
		t.Error("mounts of the lab left in the host's mount namespace")
	}
}

// buildLab builds the driver and the lab command into dir and returns the
// upstream tools' directory with them.
func buildLab(t testing.TB, dir string) (tools, driver, labBin string) {
	t.Helper()
	tools, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	build := func(out, pkg string) string {
		p := filepath.Join(dir, out)
		cmd := exec.Command("go", "build", "-o", p, pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", pkg, err, b)
		}
		return p
	}
	driver = build("harvester-csi-driver", "github.com/harvester-csi/harvester-csi-driver/cmd/harvester-csi-driver")
	labBin = build("hcsi-lab", "github.com/harvester-csi/harvester-csi-driver/cmd/hcsi-lab")
	return tools, driver, labBin
}

// readReport reads a run directory's report.json.
func readReport(t testing.TB, dir string) *lab.Report {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "report.json"))
	if err != nil {
		t.Fatalf("no report in %s: %v", dir, err)
	}
	var rep lab.Report
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatalf("%s/report.json: %v", dir, err)
	}
	return &rep
}
