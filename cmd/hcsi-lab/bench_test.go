package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

// The lab's fixed benchmark scenario: the default `make lab` (Harvester issue
// 9761's workload: 3 guest nodes, 40 namespaces, 8 schedule minutes,
// real-world timings), once per KubeVirt mode.
var (
	labBenchKubeVirt   = flag.String("lab.kubevirt", "legacy-v1.5,declarative", "comma-separated --kubevirt values, one run each")
	labBenchHarvester  = flag.String("lab.harvester", "", "comma-separated Harvester releases (hcsi-lab --harvester), one run each, instead of -lab.kubevirt")
	labBenchMinutes    = flag.Float64("lab.minutes", 8, "schedule minutes per run")
	labBenchNamespaces = flag.Int("lab.namespaces", 40, "workload namespaces")
	labBenchNodes      = flag.Int("lab.nodes", 3, "guest nodes")
	labBenchSeed       = flag.Uint64("lab.seed", 1, "seed")
	labBenchResults    = flag.String("lab.results", "../../bench/results", "where the JSON results go")
	labBenchRuns       = flag.String("lab.runs", "../../lab-runs", "where the run directories (logs, report.json) stay")
)

// Targets of the lab benchmark. A simulated hotplug cycle
// (attachment pod start and the volume becoming Ready) is about 10 s at time
// scale 1: a VolumeAttachment should be attached within two.
const (
	targetAttachP99Seconds       = 20.0
	targetWritesPerOpDeclarative = 0.5
)

// LabBenchResult is bench/results/lab-<kubevirt>.json.
type LabBenchResult struct {
	Benchmark string    `json:"benchmark"`
	Measured  time.Time `json:"measured"`
	Commit    string    `json:"commit"`
	Machine   Machine   `json:"machine"`
	Scenario  struct {
		KubeVirt   string  `json:"kubevirt"`
		Harvester  string  `json:"harvester,omitempty"`
		Nodes      int     `json:"nodes"`
		Namespaces int     `json:"namespaces"`
		Minutes    float64 `json:"minutes"`
		TimeScale  float64 `json:"time_scale"`
		Seed       uint64  `json:"seed"`
	} `json:"scenario"`
	Passed              bool                `json:"passed"`
	Stuck               int                 `json:"stuck"`
	InvariantViolations int                 `json:"invariant_violations"`
	Operations          lab.Operations      `json:"operations"`
	AttachLatency       monitor.Percentiles `json:"attach_latency_seconds"`
	DetachLatency       monitor.Percentiles `json:"detach_latency_seconds"`
	PodStartLatency     monitor.Percentiles `json:"pod_start_latency_seconds"`
	// DriverBreakdown splits the controller's time per change into its
	// queue's hold and KubeVirt's work after the write.
	DriverBreakdown    *lab.Breakdown     `json:"driver_breakdown,omitempty"`
	KubeVirtWrites     lab.KubeVirtWrites `json:"kubevirt_writes"`
	Conflicts          map[string]int     `json:"conflicts"`
	ConflictsByRequest map[string]int     `json:"conflicts_by_request,omitempty"`
	AttacherErrors     map[string]int     `json:"attacher_errors,omitempty"`
	Targets            []Target           `json:"targets"`
	Elapsed            float64            `json:"elapsed_seconds"`
	RunDir             string             `json:"run_dir"`
}

// Target is one benchmark target and whether the run met it.
type Target struct {
	Name   string  `json:"name"`
	Target float64 `json:"target"`
	Value  float64 `json:"value"`
	Met    bool    `json:"met"`
}

// Machine is what the figures were measured on; the machine is shared, so
// the load average before and after the run goes with them.
type Machine struct {
	CPU        string  `json:"cpu"`
	Cores      int     `json:"cores"`
	MemoryGiB  float64 `json:"memory_gib"`
	Kernel     string  `json:"kernel"`
	Go         string  `json:"go"`
	LoadBefore string  `json:"load_average_before"`
	LoadAfter  string  `json:"load_average_after"`
}

// BenchmarkLab runs the lab's fixed scenario through the built binaries, as
// `make lab` does, once per KubeVirt mode (the legacy subresource API on the
// default version, and declarative hotplug), and writes
// bench/results/lab-<kubevirt>.json. Its figures are measurements, never
// assertions: a run fails only when the lab itself could not run.
func BenchmarkLab(b *testing.B) {
	skipWithoutLab(b, "runs the lab's default scenario (about 20 minutes)")
	// The commit the binaries are built from (-dirty: with changes not
	// committed), taken before the build.
	commit := gitCommit()
	work := b.TempDir()
	tools, driver, labBin := buildLab(b, work)
	kubevirtSet := false
	flag.Visit(func(fl *flag.Flag) { kubevirtSet = kubevirtSet || fl.Name == "lab.kubevirt" })
	plan, err := labBenchPlan(*labBenchKubeVirt, *labBenchHarvester, kubevirtSet)
	if err != nil {
		b.Fatal(err)
	}
	for _, run := range plan {
		kv := run.kubevirt
		b.Run(cmp.Or(run.harvester, kv), func(b *testing.B) {
			for range b.N {
				res := runLabBench(b, tools, driver, labBin, run, commit)
				b.ReportMetric(float64(res.Stuck), "stuck")
				b.ReportMetric(res.AttachLatency.P99, "attach-p99-s")
				b.ReportMetric(res.KubeVirtWrites.PerVolumeOp, "kubevirt-writes/op")
				b.ReportMetric(float64(res.Conflicts["409"]+res.Conflicts["422"]), "409+422")
			}
		})
	}
}

// labRun is one run of BenchmarkLab: its --kubevirt and the --harvester
// release it stands for ("" when none was asked for).
type labRun struct{ kubevirt, harvester string }

// labBenchPlan is BenchmarkLab's runs: one per -lab.kubevirt value, or with
// -lab.harvester one per release, at the KubeVirt its profile runs.
func labBenchPlan(kubevirts, harvesters string, kubevirtSet bool) ([]labRun, error) {
	var plan []labRun
	if harvesters == "" {
		for _, kv := range strings.Split(kubevirts, ",") {
			plan = append(plan, labRun{kubevirt: kv})
		}
		return plan, nil
	}
	if kubevirtSet {
		return nil, errors.New("-lab.kubevirt and -lab.harvester: give one")
	}
	for _, r := range strings.Split(harvesters, ",") {
		kv, err := lab.HarvesterKubeVirt(r, false, "")
		if err != nil {
			return nil, fmt.Errorf("-lab.harvester: %w", err)
		}
		plan = append(plan, labRun{kubevirt: kv, harvester: r})
	}
	return plan, nil
}

func runLabBench(b *testing.B, tools, driver, labBin string, run labRun, commit string) *LabBenchResult {
	b.Helper()
	kv := run.kubevirt
	runs, err := filepath.Abs(*labBenchRuns)
	if err != nil {
		b.Fatal(err)
	}
	out := filepath.Join(runs, fmt.Sprintf("bench-%s-%s", kv, time.Now().Format("20060102-150405")))
	res := &LabBenchResult{Benchmark: "BenchmarkLab", Measured: time.Now().UTC(), Commit: commit, Machine: machine()}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(*labBenchMinutes*float64(time.Minute))+40*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, labBin, "--driver-binary="+driver, "--out="+out, "--kubevirt="+kv,
		fmt.Sprintf("--minutes=%g", *labBenchMinutes), fmt.Sprintf("--namespaces=%d", *labBenchNamespaces),
		fmt.Sprintf("--nodes=%d", *labBenchNodes), fmt.Sprintf("--seed=%d", *labBenchSeed))
	if run.harvester != "" {
		cmd.Args = append(cmd.Args, "--harvester="+run.harvester)
	}
	cmd.Env = append(os.Environ(), "HCSI_TOOLS_BIN="+tools)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stdout
	b.ResetTimer()
	runErr := cmd.Run()
	b.StopTimer()
	res.Machine.LoadAfter = loadAverage()
	rep := readReport(b, out)
	if rep.Outcome != "done" {
		b.Fatalf("the lab did not finish (exit %v, outcome %q):\n%s", runErr, rep.Outcome, stdout.String())
	}
	b.Logf("%s", rep.Summary())
	c := rep.Config
	res.Scenario.KubeVirt, res.Scenario.Nodes, res.Scenario.Namespaces = c.KubeVirt, c.Nodes, c.Namespaces
	res.Scenario.Harvester = c.Harvester
	res.Scenario.Minutes, res.Scenario.TimeScale, res.Scenario.Seed = c.Minutes, c.TimeScale, c.Seed
	res.Passed, res.Stuck, res.InvariantViolations = rep.Passed, rep.Stuck, len(rep.InvariantViolations)
	res.Operations = rep.Operations
	res.AttachLatency, res.DetachLatency, res.PodStartLatency = rep.AttachLatency, rep.DetachLatency, rep.PodStartLatency
	res.DriverBreakdown = rep.DriverBreakdown
	res.KubeVirtWrites, res.Conflicts, res.ConflictsByRequest, res.AttacherErrors = rep.KubeVirtWrites, rep.Conflicts, rep.ConflictsByRequest, rep.AttacherErrors
	res.Elapsed, res.RunDir = rep.Elapsed, out
	res.Targets = targets(rep)
	for _, t := range res.Targets {
		if !t.Met {
			b.Logf("target not met: %s = %g (target %g)", t.Name, t.Value, t.Target)
		}
	}
	if err := os.MkdirAll(*labBenchResults, 0o750); err != nil {
		b.Fatal(err)
	}
	data, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		b.Fatal(err)
	}
	path := filepath.Join(*labBenchResults, "lab-"+kv+".json")
	if err := os.WriteFile(path, append(data, '\n'), 0o640); err != nil {
		b.Fatal(err)
	}
	b.Logf("wrote %s (run directory %s)", path, out)
	return res
}

// targets are the lab benchmark's targets for rep. The writes target applies
// to declarative hotplug only: the legacy API has no batch call, so each
// attach and detach is one addvolume or removevolume call of its own.
func targets(rep *lab.Report) []Target {
	ts := []Target{
		{Name: "stuck", Target: 0, Value: float64(rep.Stuck)},
		{Name: "attach_latency_p99_seconds", Target: targetAttachP99Seconds, Value: rep.AttachLatency.P99},
		{Name: "conflicts_409_422", Target: 0, Value: float64(rep.Conflicts["409"] + rep.Conflicts["422"])},
	}
	if mode, _, err := lab.ParseKubeVirt(rep.Config.KubeVirt); err == nil && mode == "declarative" {
		ts = append(ts, Target{Name: "kubevirt_writes_per_volume_operation", Target: targetWritesPerOpDeclarative, Value: rep.KubeVirtWrites.PerVolumeOp})
	}
	for i := range ts {
		ts[i].Met = ts[i].Value <= ts[i].Target
	}
	return ts
}

func machine() Machine {
	m := Machine{Cores: runtime.NumCPU(), Go: runtime.Version(), LoadBefore: loadAverage()}
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(data), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if data, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb float64
		if _, err := fmt.Sscanf(string(data), "MemTotal: %f kB", &kb); err == nil {
			m.MemoryGiB = float64(int(kb/1024/1024*10)) / 10
		}
	}
	if data, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(data))
	}
	return m
}

func loadAverage() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

func gitCommit() string {
	out, err := exec.Command("git", "describe", "--always", "--dirty", "--abbrev=12", "--exclude=*").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

func TestLabBenchPlan(t *testing.T) {
	plan, err := labBenchPlan("legacy-v1.5,declarative", "", false)
	if want := []labRun{{kubevirt: "legacy-v1.5"}, {kubevirt: "declarative"}}; err != nil || !slices.Equal(plan, want) {
		t.Errorf("-lab.kubevirt only: %v, %v; want %v", plan, err, want)
	}
	plan, err = labBenchPlan("legacy-v1.5,declarative", "1.6.1,1.8.0", false)
	if want := []labRun{{"legacy-v1.5.3", "1.6.1"}, {"declarative-v1.7.0", "1.8.0"}}; err != nil || !slices.Equal(plan, want) {
		t.Errorf("-lab.harvester 1.6.1,1.8.0: %v, %v; want %v", plan, err, want)
	}
	if _, err := labBenchPlan("declarative", "1.8.0", true); err == nil || !strings.Contains(err.Error(), "give one") {
		t.Errorf("-lab.kubevirt and -lab.harvester together: %v, want an error", err)
	}
	if _, err := labBenchPlan("declarative", "1.8.0,1.4", false); err == nil || !strings.Contains(err.Error(), "no profile") {
		t.Errorf("-lab.harvester 1.4: %v, want an error", err)
	}
}
