package lab

import (
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

// TestWebhookDenialsAreNotConflicts: answers in which an admission webhook
// refused a write are counted apart, and only the rest of the 409s and 422s
// are conflicts.
func TestWebhookDenialsAreNotConflicts(t *testing.T) {
	patchVM := kubevirtsim.RequestKey{Verb: "patch", Group: "kubevirt.io", Resource: "virtualmachines"}
	addVolume := kubevirtsim.RequestKey{Verb: "put", Group: "subresources.kubevirt.io", Resource: "virtualmachines", Subresource: "addvolume"}
	answers := map[kubevirtsim.RequestKey]map[int]int{
		patchVM:   {200: 40, 409: 2, 422: 5},
		addVolume: {202: 10, 422: 1},
	}
	denied := map[kubevirtsim.RequestKey]map[int]int{patchVM: {422: 3}}
	conflicts, denials := answersByRequest(answers, denied)
	wantConflicts := map[string]int{
		"409 patch kubevirt.io/virtualmachines":                      2,
		"422 patch kubevirt.io/virtualmachines":                      2,
		"422 put subresources.kubevirt.io/virtualmachines/addvolume": 1,
	}
	if !maps.Equal(conflicts, wantConflicts) {
		t.Errorf("conflicts %v, want %v", conflicts, wantConflicts)
	}
	if want := map[string]int{"422 patch kubevirt.io/virtualmachines": 3}; !maps.Equal(denials, want) {
		t.Errorf("denials %v, want %v", denials, want)
	}
}

// A run whose workload did not run must not pass: this is the report of a
// quick run on a machine without mkfs.xfs, where every database stage failed
// and nothing but the backup Jobs ran.
func TestWorkloadThatDidNotRunFails(t *testing.T) {
	c := Config{Minutes: 2, MoveInterval: 4 * time.Second, ExpandEvery: 15 * time.Second, ControllerKillEvery: 40 * time.Second}
	rep := &Report{
		Operations: Operations{Attaches: 70, Detaches: 60, JobsRun: 50},
		DataChecks: DataChecks{Passed: 50},
		NodeCalls:  NodeCalls{Total: 300, Failed: 53, MissingTool: 53, MissingToolError: `mkfs.xfs: exec: "mkfs.xfs": executable file not found in $PATH`},
		Driver:     Driver{Restarts: 2},
	}
	got := workloadFailures(c, rep, []string{"ns-0/db-0", "ns-1/db-0"})
	for _, want := range []string{"2 pods never started", "53 node calls failed for a tool", "no database was moved", "no claim expansion finished"} {
		if !slices.ContainsFunc(got, func(f string) bool { return strings.Contains(f, want) }) {
			t.Errorf("failures %q: none says %q", got, want)
		}
	}
	if len(got) != 4 {
		t.Errorf("want exactly 4 failures, got %q", got)
	}

	healthy := &Report{
		Operations: Operations{Attaches: 108, Detaches: 108, JobsRun: 93, DatabaseMoves: 20, Expansions: 6},
		DataChecks: DataChecks{Passed: 120}, NodeCalls: NodeCalls{Total: 500, Failed: 3}, Driver: Driver{Restarts: 2},
	}
	if got := workloadFailures(c, healthy, nil); len(got) != 0 {
		t.Errorf("a run that did everything reports failures: %q", got)
	}
	// A fault that never struck is a scenario part that did nothing.
	healthy.Driver.Restarts = 0
	if got := workloadFailures(c, healthy, nil); len(got) != 1 || !strings.Contains(got[0], "controller-kill") {
		t.Errorf("a controller-kill fault that never struck: %q", got)
	}
}

// The lab refuses a scenario whose tools this machine lacks, naming the
// commands and their packages; XFS tools only when the databases use XFS.
func TestPreflightNamesMissingTools(t *testing.T) {
	have := func(names ...string) func(string) (string, error) {
		return func(cmd string) (string, error) {
			if slices.Contains(names, cmd) {
				return "/usr/sbin/" + cmd, nil
			}
			return "", exec.ErrNotFound
		}
	}
	c := Config{ExpandEvery: 15 * time.Second}
	base := have("losetup", "mount", "umount", "blkid", "mkfs.ext4", "resize2fs")
	if err := preflight(c.neededTools(false), base); err != nil {
		t.Errorf("ext4 scenario with every ext4 tool refused: %v", err)
	}
	err := preflight(c.neededTools(true), base)
	if err == nil || !strings.Contains(err.Error(), "mkfs.xfs, xfs_growfs") || !strings.Contains(err.Error(), "xfsprogs") {
		t.Errorf("XFS scenario without XFS tools: %v", err)
	}
}

// The progress line fits 100 columns even late in a long, busy run.
func TestProgressLineFits100Columns(t *testing.T) {
	p := progress{elapsed: 59*time.Minute + 59*time.Second, phase: "workload", jobs: 9999, attaches: 9999, detaches: 9999,
		inFlight: 999, stuck: 99, violations: 99, attach: monitor.Percentiles{P50: 99.9, P99: 999.9}}
	if line := p.String(); len(line) > 100 {
		t.Errorf("progress line is %d columns: %q", len(line), line)
	}
}

// The report names the versions tools/ pins, read from this repository.
func TestComponentsAreThePinnedVersions(t *testing.T) {
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	got := components(KubeVirtDeclarative)
	for name, v := range got {
		if strings.Contains(v, "unknown") {
			t.Errorf("%s: %s", name, v)
		}
	}
	mod, err := os.ReadFile(filepath.Join(root, "tools", "attacher", "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	ver := strings.TrimPrefix(got["csi-attacher"], "external-attacher ")
	if !strings.Contains(string(mod), " "+ver) {
		t.Errorf("csi-attacher %s is not what tools/attacher pins", ver)
	}
}

// A pod waits out Kubernetes' own recovery (up to 2 min for a VolumeAttachment
// still being deleted) without counting as never started: the grace is the
// stuck bound, not a share of the run.
func TestStartGraceIsTheStuckBound(t *testing.T) {
	c := Config{Minutes: 2, StuckBound: 3 * time.Minute}
	if got := c.startGrace(); got != 3*time.Minute {
		t.Errorf("start grace %v in a 2-minute run with a 3-minute stuck bound, want 3m", got)
	}
}
