package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab"
	"github.com/harvester-csi/harvester-csi-driver/internal/proc"
	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// The --quick lab, on its default three host nodes (the host storage path
// under every attachment pod), with NodeUnstageVolume skipped now and then,
// the controller process killed every 40 s and claims expanded every 15 s,
// must pass: no invariant broken, nothing stuck, every data check good. It
// runs the built binaries as a user would (make lab LAB_FLAGS=--quick).
func TestQuickLab(t *testing.T) {
	skipWithoutLab(t, "runs the whole lab (a few minutes)")
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
	// Claims grew online through the real resizer and kubelet (a stuck
	// expansion is a violation above).
	if rep.Operations.Expansions == 0 {
		t.Error("no claim expansion finished")
	}
	if rep.NodeCalls.UnstageSkipped == 0 {
		t.Error("the skip-unstage fault never struck")
	}
	if rep.Driver.Restarts == 0 {
		t.Error("the controller-kill fault never struck")
	}
	if rep.Config.HostNodes != defaultHostNodes || len(rep.AttachByCase) == 0 {
		t.Errorf("the run was not on the host storage path: %d host nodes, attach by case %+v", rep.Config.HostNodes, rep.AttachByCase)
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

// The quick lab on the host storage path (KubeVirt v1.7.0's real control
// plane, three host nodes with Longhorn's stand-in) with a host node
// cordoned now and then must pass: the VM's next attachment pod waits
// Pending on the cordoned node, every change of that VM waits behind it,
// and nothing may end stuck or break an invariant, the host-node one
// included. Shorter than TestQuickLab and without its driver faults, which
// that test covers: this one adds a few minutes to make test.
func TestQuickLabHostFault(t *testing.T) {
	skipWithoutLab(t, "runs the whole lab on host nodes (a few minutes)")
	const kubevirt = "v1.7.0"
	work := t.TempDir()
	bin, driver, labBin := buildLab(t, work)
	if !realkubevirt.Built(bin, kubevirt) {
		t.Skipf("KubeVirt %s binaries are not in %s: hack/tools.sh builds them", kubevirt, bin)
	}
	out := filepath.Join(work, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, labBin, "--quick", "--kubevirt=real-legacy-"+kubevirt, "--host-nodes=3",
		"--minutes=1.5", "--kill-controller-every=0", "--expand-every=0", "--skip-unstage=0",
		"--cordon-host=15s", "--cordon-host-every=40s", "--migrate-vms=40s", "--drain-nodes=45s", "--driver-binary="+driver, "--out="+out)
	cmd.Env = append(os.Environ(), "HCSI_TOOLS_BIN="+bin)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stdout
	runErr := cmd.Run()
	t.Logf("hcsi-lab output:\n%s", stdout.String())
	rep := readReport(t, out)
	if runErr != nil || !rep.Passed {
		for _, v := range rep.InvariantViolations {
			t.Errorf("violation: %s", v)
		}
		t.Fatalf("the quick lab on host nodes failed (exit %v, outcome %s, stuck %d, workload failures %q); logs in %s",
			runErr, rep.Outcome, rep.Stuck, rep.WorkloadFailures, filepath.Join(out, "logs"))
	}
	var cordons int
	for _, f := range rep.HostFaults {
		if f.Fault == "cordon-host" && !f.End.IsZero() {
			cordons++
		}
	}
	if cordons == 0 {
		t.Errorf("no host node was cordoned and uncordoned: %+v", rep.HostFaults)
	}
	if len(rep.AttachByCase) == 0 || len(rep.DetachByCase) == 0 {
		t.Errorf("no latency by case: attach %+v, detach %+v", rep.AttachByCase, rep.DetachByCase)
	}
	if rep.DriverBreakdown == nil || rep.DriverBreakdown.Host == nil || rep.DriverBreakdown.Host.Scheduling.N == 0 {
		t.Errorf("no host part in the breakdown: %+v", rep.DriverBreakdown)
	}
	// Every guest VM live-migrated once (the hot-plugs the migration caught
	// withdrawn and written again, the others held), and every guest node
	// was drained once.
	if lab, err := os.ReadFile(filepath.Join(out, "logs", "lab.log")); err != nil || !strings.Contains(string(lab), "live migration round done") {
		t.Errorf("no live migration round ended (lab.log: %v)", err)
	}
	drained := map[string]bool{}
	for _, f := range rep.GuestFaults {
		if f.Fault == "drain-guest-node" && !f.End.IsZero() {
			drained[f.Target] = true
		}
	}
	if len(drained) == 0 {
		t.Errorf("no guest node was drained and uncordoned: %+v", rep.GuestFaults)
	}
}

// skipWithoutLab skips where the lab cannot run (it needs root for loop
// devices, mounts and a mount namespace) and in -short runs, saying why.
func skipWithoutLab(tb testing.TB, long string) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("the lab needs root (loop devices, mounts, a mount namespace)")
	}
	if testing.Short() {
		tb.Skip(long)
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
		if err := proc.Build(context.Background(), p, pkg); err != nil {
			t.Fatal(err)
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

// fakeUpstream is a controller binary that takes only upstream's flags, as
// --compare expects: it records its arguments, says who it is in its log and
// runs this driver's controller with them.
const fakeUpstream = `#!/bin/sh
if [ "$1" = --version ]; then echo "fake-upstream v0.0.0"; exit 0; fi
printf '%s\n' "$@" > "$(dirname "$0")/fake-upstream.args"
for a in "$@"; do
	case "$a" in
	--endpoint=*|--nodeid=*|--kubeconfig=*|--host-storage-class=*) ;;
	*) echo "fake-upstream: not one of upstream's flags: $a" >&2; exit 2 ;;
	esac
done
echo "fake-upstream: controller starting" >&2
exec "$(dirname "$0")/harvester-csi-driver" --mode=controller "$@"
`

// --compare PATH runs the scenario twice, this driver's controller and then
// PATH with upstream's flags, and prints both columns: each column must hold
// the figures of its own run.
func TestLabCompare(t *testing.T) {
	skipWithoutLab(t, "runs the lab twice (a few minutes)")
	work := t.TempDir()
	tools, driver, labBin := buildLab(t, work)
	fake := filepath.Join(work, "fake-upstream")
	if err := os.WriteFile(fake, []byte(fakeUpstream), 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(work, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	// Short, without faults and on the kubelet stand-in (--host-nodes 0, which
	// this keeps covered): TestQuickLab covers the faults and host nodes.
	cmd := exec.CommandContext(ctx, labBin, "--quick", "--minutes=0.75", "--namespaces=3", "--skip-unstage=0", "--kill-controller-every=0", "--host-nodes=0",
		"--driver-binary="+driver, "--out="+out, "--compare="+fake)
	cmd.Env = append(os.Environ(), "HCSI_TOOLS_BIN="+tools)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stdout
	runErr := cmd.Run()
	t.Logf("hcsi-lab output:\n%s", stdout.String())
	if runErr != nil {
		t.Errorf("hcsi-lab --compare: %v", runErr)
	}
	ours, theirs := readReport(t, filepath.Join(out, "this-driver")), readReport(t, filepath.Join(out, "compared"))

	// Two real runs: each did the work, each with its own controller.
	for name, rep := range map[string]*lab.Report{"this driver": ours, "compared": theirs} {
		if rep.Outcome != "done" || rep.Operations.Attaches == 0 || rep.Operations.Detaches == 0 || rep.Operations.JobsRun == 0 {
			t.Errorf("%s: the run did not do the workload: outcome %s, %+v", name, rep.Outcome, rep.Operations)
		}
		if rep.AttachLatency.N == 0 {
			t.Errorf("%s: no attach latency measured", name)
		}
	}
	if ours.Driver.Binary != driver || theirs.Driver.Binary != fake || theirs.Driver.Version != "fake-upstream v0.0.0" {
		t.Errorf("controllers: this driver ran %s, compared ran %s (%s); want %s and %s", ours.Driver.Binary, theirs.Driver.Binary, theirs.Driver.Version, driver, fake)
	}
	args, err := os.ReadFile(filepath.Join(work, "fake-upstream.args"))
	if err != nil {
		t.Fatalf("the compared binary never ran: %v", err)
	}
	var flags []string
	for _, a := range strings.Fields(string(args)) {
		name, _, _ := strings.Cut(a, "=")
		flags = append(flags, name)
	}
	if got := strings.Join(flags, " "); got != "--endpoint --nodeid --kubeconfig --host-storage-class" {
		t.Errorf("the compared binary got flags %q, want upstream's four", got)
	}
	for dir, want := range map[string]bool{"this-driver": false, "compared": true} {
		log, err := os.ReadFile(filepath.Join(out, dir, "logs", "driver-controller.log"))
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Contains(string(log), "fake-upstream: controller starting"); got != want {
			t.Errorf("%s/logs/driver-controller.log: the compared binary's line present = %v, want %v", dir, got, want)
		}
	}

	// The printed columns are the two reports' figures.
	table := stdout.String()
	if i := strings.Index(table, "comparison (same scenario"); i >= 0 {
		table = table[i:]
	} else {
		t.Fatal("no comparison printed")
	}
	row := func(name string) []string {
		for _, l := range strings.Split(table, "\n") {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(l), name); ok {
				return strings.Fields(rest)
			}
		}
		t.Errorf("no row %q in the comparison", name)
		return nil
	}
	check := func(name string, want ...string) {
		if got := row(name); strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("row %q = %q, want %q", name, got, want)
		}
	}
	ops := func(r *lab.Report) []string {
		return []string{fmt.Sprint(r.Operations.Attaches), "/", fmt.Sprint(r.Operations.Detaches)}
	}
	check("attaches / detaches", append(ops(ours), ops(theirs)...)...)
	check("jobs run", fmt.Sprint(ours.Operations.JobsRun), fmt.Sprint(theirs.Operations.JobsRun))
	check("stuck", fmt.Sprint(ours.Stuck), fmt.Sprint(theirs.Stuck))
	check("attach (VA created -> attached) p50", fmt.Sprintf("%.1fs", ours.AttachLatency.P50), fmt.Sprintf("%.1fs", theirs.AttachLatency.P50))
	check("KubeVirt writes per volume op", fmt.Sprintf("%.2f", ours.KubeVirtWrites.PerVolumeOp), fmt.Sprintf("%.2f", theirs.KubeVirtWrites.PerVolumeOp))
}

// --help says what the lab is before listing its flags, and every line of
// that text fits a terminal.
func TestHelpSaysWhatTheLabIs(t *testing.T) {
	var out strings.Builder
	if _, err := parse([]string{"--help"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	text := out.String()
	intro, flags, ok := strings.Cut(text, "Usage: hcsi-lab")
	if !ok || !strings.Contains(intro, "simulated Harvester host") || !strings.Contains(intro, "Exit status") {
		t.Errorf("--help does not begin by saying what the lab is:\n%s", text)
	}
	for _, l := range strings.Split(intro, "\n") {
		if len(l) > 110 {
			t.Errorf("help line of %d columns: %q", len(l), l)
		}
	}
	for _, name := range []string{"-quick", "-compare", "-kubevirt", "-kill-controller-every"} {
		if !strings.Contains(flags, name) {
			t.Errorf("--help lacks %s", name)
		}
	}
}

// The defaults that live in the checkout (the run directory) come from the
// checkout, not from wherever --manifests points.
func TestDefaultsComeFromTheCheckoutWhateverTheManifests(t *testing.T) {
	dir := t.TempDir()
	manifests := filepath.Join(dir, "elsewhere", "rendered.yaml")
	driver := filepath.Join(dir, "harvester-csi-driver")
	for _, p := range []string{manifests, driver} {
		if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f, err := parse([]string{"--manifests", manifests, "--driver-binary", driver}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	if got := filepath.Dir(f.cfg.Out); got != filepath.Join(root, "lab-runs") {
		t.Errorf("run directory %s, want one in %s", f.cfg.Out, filepath.Join(root, "lab-runs"))
	}
	if f.cfg.Manifests != manifests || f.cfg.DriverBinary != driver {
		t.Errorf("--manifests %s and --driver-binary %s became %s and %s", manifests, driver, f.cfg.Manifests, f.cfg.DriverBinary)
	}
}

func TestHarvesterFlag(t *testing.T) {
	base := parseBase(t)
	for _, tc := range []struct {
		args              []string
		kubevirt, harvest string
		wantErr           string
	}{
		{args: nil, kubevirt: lab.KubeVirtLegacyV15},
		{args: []string{"--kubevirt", "declarative"}, kubevirt: "declarative"},
		{args: []string{"--harvester", "1.8.0"}, kubevirt: "declarative-v1.7.0", harvest: "1.8.0"},
		{args: []string{"--harvester", "1.7.2", "--real"}, kubevirt: "real-legacy-v1.6.0", harvest: "1.7.2"},
		{args: []string{"--harvester", "1.8.1", "--kubevirt", "declarative"}, kubevirt: "declarative", harvest: "1.8.1"},
		{args: []string{"--harvester", "1.8.0", "--kubevirt", "legacy-v1.5"}, wantErr: "disagree"},
		{args: []string{"--harvester", "1.6.0", "--real"}, wantErr: "no real control plane"},
		{args: []string{"--harvester", "2.0"}, wantErr: "no profile"},
		{args: []string{"--real"}, wantErr: "--real goes with --harvester"},
	} {
		f, err := parse(append(append([]string{}, base...), tc.args...), io.Discard)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%q: %v, want an error with %q", tc.args, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.args, err)
			continue
		}
		if f.cfg.KubeVirt != tc.kubevirt || f.cfg.Harvester != tc.harvest {
			t.Errorf("%q: --kubevirt %q, harvester %q; want %q, %q", tc.args, f.cfg.KubeVirt, f.cfg.Harvester, tc.kubevirt, tc.harvest)
		}
	}
}

// The host storage path is on by default, on three host nodes, for the
// default scenario and --quick alike; --host-nodes 0 keeps the kubelet
// stand-in, which the faults that need it ask for by name.
func TestHostNodesByDefault(t *testing.T) {
	base := parseBase(t)
	for _, tc := range []struct {
		args []string
		want int
	}{
		{args: nil, want: 3},
		{args: []string{"--quick"}, want: 3},
		{args: []string{"--harvester", "1.8.0"}, want: 3},
		{args: []string{"--host-nodes", "0"}, want: 0},
		{args: []string{"--quick", "--host-nodes", "0"}, want: 0},
		{args: []string{"--host-nodes", "0", "--attachment-pod-stuck", "5s"}, want: 0},
		{args: []string{"--host-nodes", "0", "--migrate-vms", "1m"}, want: 0},
	} {
		f, err := parse(append(append([]string{}, base...), tc.args...), io.Discard)
		if err != nil {
			t.Errorf("%q: %v", tc.args, err)
			continue
		}
		if f.cfg.HostNodes != tc.want {
			t.Errorf("%q: %d host nodes, want %d", tc.args, f.cfg.HostNodes, tc.want)
		}
	}
	// A fault that needs the stand-in says how to get it.
	for _, fl := range []string{"--attachment-pod-stuck"} {
		_, err := parse(append(append([]string{}, base...), fl, "5s"), io.Discard)
		if err == nil || !strings.Contains(err.Error(), "--host-nodes 0") {
			t.Errorf("%s on the default host nodes: %v, want a refusal naming --host-nodes 0", fl, err)
		}
	}
}

// --host-nodes turns the host storage path on, over KubeVirt's real
// control plane and over the simulated one (the default profile's).
func TestHostNodesFlag(t *testing.T) {
	base := parseBase(t)
	f, err := parse(append(append([]string{}, base...), "--kubevirt", "real-legacy-v1.7.0", "--host-nodes", "3"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if f.cfg.HostNodes != 3 {
		t.Errorf("--host-nodes 3 gave %d host nodes", f.cfg.HostNodes)
	}
	f, err = parse(append(append([]string{}, base...), "--host-nodes", "3"), io.Discard)
	if err != nil {
		t.Fatalf("--host-nodes 3 on the simulated control plane: %v", err)
	}
	if f.cfg.HostNodes != 3 {
		t.Errorf("--host-nodes 3 on the simulated control plane gave %d host nodes", f.cfg.HostNodes)
	}
	// The migration runs on the host nodes' kubelets (KubeVirt's real
	// control plane refuses the fault without host nodes when the run
	// starts: internal/lab TestMigrateVMsNeedsHostNodesOnTheRealControlPlane).
	f, err = parse(append(append([]string{}, base...), "--host-nodes", "3", "--migrate-vms", "1m"), io.Discard)
	if err != nil || f.cfg.MigrateVMsEvery != time.Minute {
		t.Errorf("--host-nodes 3 --migrate-vms 1m on the simulated control plane: %v, want accepted", err)
	}
	for _, args := range [][]string{{"--host-nodes", "-1"}, {"--kubevirt", "real-v1.7.0", "--host-nodes", "-1"}, {"--host-nodes", "3", "--attachment-pod-stuck", "5s"}} {
		if _, err := parse(append(append([]string{}, base...), args...), io.Discard); err == nil {
			t.Errorf("%q: accepted, want a refusal", args)
		}
	}
}

// The host faults are flags of their own, refused with --host-nodes 0.
func TestHostFaultFlags(t *testing.T) {
	base := append(parseBase(t), "--kubevirt", "real-legacy-v1.7.0")
	f, err := parse(append(append([]string{}, base...), "--host-nodes", "3", "--longhorn-faulted", "5s", "--cordon-host", "6s",
		"--cordon-host-every", "30s", "--slow-host-detach", "7s", "--ghost-workload", "8s"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c := f.cfg
	if c.LonghornFaulted != 5*time.Second || c.CordonHost != 6*time.Second || c.CordonHostEvery != 30*time.Second ||
		c.SlowHostDetach != 7*time.Second || c.GhostWorkload != 8*time.Second {
		t.Errorf("host faults not set as asked: %+v", c)
	}
	for _, fl := range []string{"--longhorn-faulted", "--cordon-host", "--slow-host-detach", "--ghost-workload"} {
		_, err := parse(append(append([]string{}, base...), "--host-nodes", "0", fl, "5s"), io.Discard)
		if err == nil || !strings.Contains(err.Error(), fl+" needs host nodes") {
			t.Errorf("%s with --host-nodes 0: %v, want a refusal", fl, err)
		}
	}
}

// parseBase is the flags every parse test starts from: a driver binary
// that exists, manifests and an output directory in a temporary directory.
func parseBase(t *testing.T) []string {
	t.Helper()
	dir := t.TempDir()
	driver := filepath.Join(dir, "harvester-csi-driver")
	if err := os.WriteFile(driver, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return []string{"--manifests", filepath.Join(dir, "m.yaml"), "--driver-binary", driver, "--out", filepath.Join(dir, "out")}
}

// The guest node roll is a fault of its own, on any KubeVirt and host.
func TestDrainNodesFlag(t *testing.T) {
	for _, extra := range [][]string{{"--host-nodes", "0"}, {"--kubevirt", "real-legacy-v1.7.0"}} {
		f, err := parse(append(append(parseBase(t), extra...), "--drain-nodes", "90s"), io.Discard)
		if err != nil || f.cfg.DrainNodesEvery != 90*time.Second {
			t.Errorf("%q --drain-nodes 90s: %v, %v; want accepted, every 90s", extra, err, f)
		}
	}
}
