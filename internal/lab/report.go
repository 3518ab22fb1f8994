package lab

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/agent"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/invariants"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

// Report is report.json.
type Report struct {
	Passed              bool                   `json:"passed"`
	Outcome             string                 `json:"outcome"`
	Stuck               int                    `json:"stuck"`
	InvariantViolations []invariants.Violation `json:"invariant_violations"`
	// WorkloadFailures name the parts of the scenario that did not happen
	// (pods that never started, a part that did nothing, node calls that
	// failed for a tool this machine lacks): such a run says nothing about
	// the driver, so it does not pass.
	WorkloadFailures []string            `json:"workload_failures,omitempty"`
	Operations       Operations          `json:"operations"`
	AttachLatency    monitor.Percentiles `json:"attach_latency_seconds"`
	DetachLatency    monitor.Percentiles `json:"detach_latency_seconds"`
	PodStartLatency  monitor.Percentiles `json:"pod_start_latency_seconds"`
	// ExpandLatency: claim expansion asked to the claim at its new size
	// with no resize pending (--expand-every).
	ExpandLatency monitor.Percentiles `json:"expand_latency_seconds"`
	// DriverBreakdown is the controller's own split of its hotplug time
	// (absent for a controller that does not log it).
	DriverBreakdown *Breakdown     `json:"driver_breakdown,omitempty"`
	KubeVirtWrites  KubeVirtWrites `json:"kubevirt_writes"`
	Conflicts       map[string]int `json:"conflicts"`
	// ConflictsByRequest splits Conflicts by the request answered ("409
	// patch kubevirt.io/virtualmachines"): in the lab only the driver's
	// processes write through KubeVirt's front (the simulator's own
	// controllers bypass it), so these are the driver's.
	ConflictsByRequest map[string]int `json:"conflicts_by_request,omitempty"`
	// WebhookDenials counts, by request, the answers in which an admission
	// webhook refused a write (the --deny-hotplug fault's webhook, or a
	// policy): not conflicts, and not in Conflicts.
	WebhookDenials map[string]int    `json:"webhook_denials,omitempty"`
	AttacherErrors map[string]int    `json:"attacher_errors"`
	Driver         Driver            `json:"driver"`
	DataChecks     DataChecks        `json:"data_checks"`
	NodeCalls      NodeCalls         `json:"node_calls"`
	Config         Config            `json:"config"`
	Components     map[string]string `json:"components"`
	Started        time.Time         `json:"started"`
	Elapsed        float64           `json:"elapsed_seconds"`
	RunDir         string            `json:"run_dir"`
	// Samples for latency.svg.
	AttachSamples []monitor.Sample `json:"attach_samples,omitempty"`
	DetachSamples []monitor.Sample `json:"detach_samples,omitempty"`
	InFlight      []InFlight       `json:"in_flight,omitempty"`

	// HostFaults are the host faults played (--longhorn-faulted,
	// --cordon-host, --slow-host-detach, --ghost-workload), each with its
	// target, start and end.
	HostFaults []FaultEvent `json:"host_faults,omitempty"`
	// GuestFaults are the guest node drains played (--drain-nodes), one
	// per node drained, from its cordon to its uncordon.
	GuestFaults []FaultEvent `json:"guest_faults,omitempty"`
	// AttachByCase and DetachByCase split the latencies by where the host
	// had the volume when the operation started (with host nodes).
	AttachByCase []CaseLatency `json:"attach_latency_by_case,omitempty"`
	DetachByCase []CaseLatency `json:"detach_latency_by_case,omitempty"`
}

// Operations counts what the workload did.
type Operations struct {
	Attaches      int `json:"attaches"`
	Detaches      int `json:"detaches"`
	JobsRun       int `json:"jobs_run"`
	JobsFailed    int `json:"jobs_failed"`
	DatabaseMoves int `json:"database_moves"`
	// Expansions done (a stuck one is a violation).
	Expansions int `json:"expansions"`
}

// KubeVirtWrites counts the writes that reached KubeVirt (the simulator's
// front proxy).
type KubeVirtWrites struct {
	Total        int     `json:"total"`
	VMSpec       int     `json:"vm_spec"`
	VMStatus     int     `json:"vm_status"`
	VMI          int     `json:"vmi"`
	AddVolume    int     `json:"addvolume"`
	RemoveVolume int     `json:"removevolume"`
	PerVolumeOp  float64 `json:"per_volume_operation"`
}

// Driver describes the controller process.
type Driver struct {
	Binary   string `json:"binary"`
	Version  string `json:"version"`
	Restarts int    `json:"restarts"`
}

// DataChecks counts the workload's verifications.
type DataChecks struct {
	Passed int `json:"passed"`
	Failed int `json:"failed"`
}

// NodeCalls counts the kubelets' node calls through the taps.
type NodeCalls struct {
	Total          int `json:"total"`
	Failed         int `json:"failed"`
	UnstageSkipped int `json:"unstage_skipped"`
	// MissingTool counts the failed calls that ran a command this machine
	// does not have, and MissingToolError is the first such answer.
	MissingTool      int    `json:"missing_tool,omitempty"`
	MissingToolError string `json:"missing_tool_error,omitempty"`
}

// workloadFailures says which parts of the scenario did not happen.
// unstarted are the pods that never ran although they were created well
// before the run ended.
func workloadFailures(c Config, rep *Report, unstarted []string) []string {
	var out []string
	o := rep.Operations
	add := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	if len(unstarted) > 0 {
		shown := unstarted
		if len(shown) > 5 {
			shown = shown[:5]
		}
		add("%d pods never started within the run: %s", len(unstarted), strings.Join(shown, ", "))
	}
	if n := rep.NodeCalls.MissingTool; n > 0 {
		add("%d node calls failed for a tool this machine lacks (`make os-deps` as root installs them): %s", n, rep.NodeCalls.MissingToolError)
	}
	if o.JobsRun == 0 {
		add("no Job ran")
	}
	if o.Attaches == 0 || o.Detaches == 0 {
		add("the workload made %d attaches and %d detaches: every scenario makes both", o.Attaches, o.Detaches)
	}
	if rep.DataChecks.Passed == 0 {
		add("no data check passed: no workload pod wrote and read back its volume")
	}
	if c.MoveInterval > 0 && o.DatabaseMoves == 0 {
		add("no database was moved (one every %s was asked)", c.MoveInterval)
	}
	if c.ExpandEvery > 0 && o.Expansions == 0 {
		add("no claim expansion finished (one every %s was asked)", c.ExpandEvery)
	}
	runFor := time.Duration(c.Minutes * float64(time.Minute))
	if c.ControllerKillEvery > 0 && runFor > c.ControllerKillEvery && rep.Driver.Restarts == 0 {
		add("the controller-kill fault never struck (every %s in a %s run)", c.ControllerKillEvery, runFor)
	}
	return out
}

// conflictsByRequest counts the 409 and 422 answers of the front proxy by
// request, and apart from them the answers in which an admission webhook
// refused the request: those are a policy's word (the --deny-hotplug fault),
// not a race.
func (r *run) conflictsByRequest() (conflicts, denials map[string]int) {
	st := r.hostStats()
	return answersByRequest(st.Answers, st.Denied)
}

func answersByRequest(answers, denied map[kubevirtsim.RequestKey]map[int]int) (conflicts, denials map[string]int) {
	conflicts, denials = map[string]int{}, map[string]int{}
	name := func(k kubevirtsim.RequestKey, code int) string {
		res := k.Group + "/" + k.Resource
		if k.Subresource != "" {
			res += "/" + k.Subresource
		}
		return fmt.Sprintf("%d %s %s", code, k.Verb, res)
	}
	for k, codes := range denied {
		for code, n := range codes {
			if n > 0 {
				denials[name(k, code)] += n
			}
		}
	}
	for k, codes := range answers {
		for _, code := range []int{http.StatusConflict, http.StatusUnprocessableEntity} {
			if n := codes[code] - denied[k][code]; n > 0 {
				conflicts[name(k, code)] += n
			}
		}
	}
	return conflicts, denials
}

func (r *run) figures() (monitor.Snapshot, KubeVirtWrites, map[string]int) {
	s := r.mon.Snapshot()
	st := r.hostStats()
	kw := KubeVirtWrites{VMSpec: st.VMSpecWrites, VMStatus: st.VMStatusWrites, VMI: st.VMIWrites, AddVolume: st.AddVolume, RemoveVolume: st.RemoveVolume}
	kw.Total = kw.VMSpec + kw.VMStatus + kw.VMI + kw.AddVolume + kw.RemoveVolume
	if ops := s.Attaches + s.Detaches; ops > 0 {
		kw.PerVolumeOp = float64(kw.Total) / float64(ops)
	}
	c409, c422 := st.Contended()
	return s, kw, map[string]int{"409": c409, "422": c422}
}

func (r *run) stuckCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, v := range r.violations {
		if v.Kind == invariants.KindStuck {
			n++
		}
	}
	return n
}

// progressLoop prints the live progress line: in place every second on a
// terminal, one line every 10 s otherwise.
func (r *run) progressLoop(ctx context.Context) {
	if r.c.Progress == nil {
		return
	}
	period := 10 * time.Second
	if r.c.TTY {
		period = time.Second
	}
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			if r.c.TTY {
				fmt.Fprintln(r.c.Progress)
			}
			return
		case <-t.C:
		}
		line := r.progressLine()
		if r.c.TTY {
			fmt.Fprintf(r.c.Progress, "\r\033[K%s", line)
		} else {
			fmt.Fprintln(r.c.Progress, line)
		}
	}
}

func (r *run) progressLine() string {
	s := r.mon.Snapshot()
	r.mu.Lock()
	phase, nviol := r.phase, len(r.violations)
	r.mu.Unlock()
	return progress{
		elapsed: time.Since(r.start), phase: phase, jobs: s.JobsSucceeded, attaches: s.Attaches, detaches: s.Detaches,
		inFlight: s.Attaching + s.Detaching, stuck: r.stuckCount(), violations: nviol, attach: monitor.Summarize(s.Attach),
	}.String()
}

// progress is what the live progress line shows.
type progress struct {
	elapsed                               time.Duration
	phase                                 string
	jobs, attaches, detaches, inFlight    int
	stuck, violations, writes, c409, c422 int
	attach                                monitor.Percentiles
}

// String fits a terminal of 100 columns for runs of up to an hour with
// four-digit counts; KubeVirt writes and conflicts are in the summary.
func (p progress) String() string {
	return fmt.Sprintf("[%s %s] jobs %d att/det %d/%d flight %d stuck %d viol %d attach p50/p99 %.1f/%.1fs",
		p.elapsed.Round(time.Second), p.phase, p.jobs, p.attaches, p.detaches, p.inFlight, p.stuck, p.violations,
		p.attach.P50, p.attach.P99)
}

// report writes report.json and summary.txt and returns the report.
func (r *run) report(ctx context.Context, outcome string) (*Report, error) {
	rep := &Report{Outcome: outcome, Config: r.c, Started: r.start, Elapsed: time.Since(r.start).Seconds(), RunDir: r.c.Out}
	if r.mon != nil {
		s, kw, conf := r.figures()
		rep.Operations = Operations{Attaches: s.Attaches, Detaches: s.Detaches, JobsRun: s.JobsSucceeded + s.JobsFailed, JobsFailed: s.JobsFailed}
		rep.AttachLatency, rep.DetachLatency, rep.PodStartLatency = monitor.Summarize(s.Attach), monitor.Summarize(s.Detach), monitor.Summarize(s.PodStart)
		rep.KubeVirtWrites, rep.Conflicts, rep.AttacherErrors = kw, conf, s.AttacherErrors
		rep.ConflictsByRequest, rep.WebhookDenials = r.conflictsByRequest()
		rep.AttachSamples, rep.DetachSamples = s.Attach, s.Detach
		rep.AttachByCase, rep.DetachByCase = byCase(s.Attach), byCase(s.Detach)
	}
	if r.wl != nil {
		rep.Operations.DatabaseMoves = r.wl.Moves()
	}
	if evs, err := agent.ReadEvents(r.results); err == nil {
		for _, e := range evs {
			if e.OK {
				rep.DataChecks.Passed++
			} else {
				rep.DataChecks.Failed++
			}
		}
	}
	r.mu.Lock()
	rep.InvariantViolations = append([]invariants.Violation{}, r.violations...)
	rep.NodeCalls = NodeCalls{Total: r.taps.calls, Failed: r.taps.failed, UnstageSkipped: r.taps.skipped,
		MissingTool: r.taps.missingTool, MissingToolError: r.taps.missingToolErr}
	unstarted := r.unstarted
	rep.InFlight = append([]InFlight(nil), r.inflight...)
	for _, f := range r.faults {
		if f.Fault == faultDrainNode {
			rep.GuestFaults = append(rep.GuestFaults, f)
		} else {
			rep.HostFaults = append(rep.HostFaults, f)
		}
	}
	rep.Operations.Expansions = len(r.expansions)
	rep.ExpandLatency = monitor.Summarize(r.expansions)
	r.mu.Unlock()
	rep.Stuck = r.stuckCount()
	bin := r.c.DriverBinary
	if r.c.ControllerBinary != "" {
		bin = r.c.ControllerBinary
	}
	rep.Driver = Driver{Binary: bin, Version: versionOf(ctx, bin)}
	if r.g != nil {
		if p := r.g.Controller(); p != nil {
			rep.Driver.Restarts = p.Starts() - 1
		}
		bd, err := readBreakdown(r.g.Procs.LogPath("driver-controller"))
		if err != nil {
			r.log.Error(err, "driver's hotplug breakdown")
		}
		rep.DriverBreakdown = withHost(bd, r.hostPath.breakdown())
	}
	rep.Components = components(r.c.KubeVirt)
	if outcome == "done" {
		rep.WorkloadFailures = workloadFailures(r.c, rep, unstarted)
	}
	rep.Passed = outcome == "done" && len(rep.InvariantViolations) == 0 && rep.Stuck == 0 && len(rep.WorkloadFailures) == 0
	data, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return rep, err
	}
	if err := os.WriteFile(filepath.Join(r.c.Out, "report.json"), data, 0o640); err != nil {
		return rep, err
	}
	if err := writeLatencySVG(filepath.Join(r.c.Out, "latency.svg"), rep); err != nil {
		r.log.Error(err, "latency.svg")
	}
	return rep, os.WriteFile(filepath.Join(r.c.Out, "summary.txt"), []byte(rep.Summary()), 0o640)
}

func versionOf(ctx context.Context, bin string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
}

// Summary is the plain-text summary.
func (rep *Report) Summary() string {
	var b strings.Builder
	verdict := "PASSED"
	if !rep.Passed {
		verdict = "FAILED"
	}
	c := rep.Config
	fmt.Fprintf(&b, "hcsi-lab %s (%s) in %s\n", verdict, rep.Outcome, time.Duration(rep.Elapsed*float64(time.Second)).Round(time.Second))
	fmt.Fprintf(&b, "  scenario: %d nodes, %d namespaces, %.1f min, KubeVirt %s, time scale %g, seed %d\n",
		c.Nodes, c.Namespaces, c.Minutes, c.KubeVirt, c.TimeScale, c.Seed)
	if c.Harvester != "" {
		fmt.Fprintf(&b, "  Harvester %s (--harvester)\n", c.Harvester)
	}
	if c.ExpandEvery > 0 {
		fs := cmp.Or(c.DBFSType, "the chart's class")
		fmt.Fprintf(&b, "  a database claim expanded every %s (databases' filesystem: %s)\n", c.ExpandEvery, fs)
	}
	fmt.Fprintf(&b, "  driver: %s (%s), controller restarts %d\n", rep.Driver.Binary, rep.Driver.Version, rep.Driver.Restarts)
	o := rep.Operations
	fmt.Fprintf(&b, "  operations: %d attaches, %d detaches, %d jobs run (%d failed), %d database moves, %d claim expansions\n", o.Attaches, o.Detaches, o.JobsRun, o.JobsFailed, o.DatabaseMoves, o.Expansions)
	pl := func(name string, p monitor.Percentiles) {
		fmt.Fprintf(&b, "  %-18s p50 %6.1fs  p95 %6.1fs  p99 %6.1fs  max %6.1fs  (n=%d)\n", name, p.P50, p.P95, p.P99, p.Max, p.N)
	}
	pl("attach latency:", rep.AttachLatency)
	pl("detach latency:", rep.DetachLatency)
	pl("pod start:", rep.PodStartLatency)
	if rep.Config.ExpandEvery > 0 {
		pl("claim expansion:", rep.ExpandLatency)
	}
	writeByCase(&b, "attach", rep.AttachByCase)
	writeByCase(&b, "detach", rep.DetachByCase)
	if bd := rep.DriverBreakdown; bd != nil && bd.AttachHeld.N+bd.DetachHeld.N > 0 {
		fmt.Fprintf(&b, "  the controller's time per volume change: held by its queue, then KubeVirt's work after the write\n")
		pl("  attach held:", bd.AttachHeld)
		pl("  attach KubeVirt:", bd.AttachHost)
		pl("  detach held:", bd.DetachHeld)
		pl("  detach KubeVirt:", bd.DetachHost)
	}
	if bd := rep.DriverBreakdown; bd != nil && bd.Host != nil {
		fmt.Fprintf(&b, "  the host's part, per attachment pod (inside KubeVirt's): created to scheduled, to its volumes attached on that host node, to Running\n")
		pl("  pod scheduled:", bd.Host.Scheduling)
		pl("  host attach:", bd.Host.Attach)
		pl("  pod to Running:", bd.Host.Start)
	}
	kw := rep.KubeVirtWrites
	if _, _, real, _ := ParseRealKubeVirt(c.KubeVirt); real {
		// Zeros there would read as a driver that never wrote.
		fmt.Fprintf(&b, "  KubeVirt writes and conflicts: not counted (KubeVirt's real control plane has no counting proxy)\n")
	} else {
		fmt.Fprintf(&b, "  KubeVirt writes: %d (%.2f per volume operation; spec %d, status %d, VMI %d, addvolume %d, removevolume %d)\n",
			kw.Total, kw.PerVolumeOp, kw.VMSpec, kw.VMStatus, kw.VMI, kw.AddVolume, kw.RemoveVolume)
		fmt.Fprintf(&b, "  conflicts: 409 x%d, 422 x%d\n", rep.Conflicts["409"], rep.Conflicts["422"])
	}
	for _, k := range slices.Sorted(maps.Keys(rep.ConflictsByRequest)) {
		fmt.Fprintf(&b, "    %4dx %s\n", rep.ConflictsByRequest[k], k)
	}
	if len(rep.WebhookDenials) > 0 {
		fmt.Fprintf(&b, "  refused by an admission webhook (a policy's answer, e.g. --deny-hotplug; not conflicts):\n")
		for _, k := range slices.Sorted(maps.Keys(rep.WebhookDenials)) {
			fmt.Fprintf(&b, "    %4dx %s\n", rep.WebhookDenials[k], k)
		}
	}
	writeFaults(&b, "host faults played", rep.Started, rep.HostFaults)
	writeFaults(&b, "guest nodes drained", rep.Started, rep.GuestFaults)
	fmt.Fprintf(&b, "  data checks: %d passed, %d failed; node calls %d (%d failed, %d NodeUnstage skipped by the fault)\n",
		rep.DataChecks.Passed, rep.DataChecks.Failed, rep.NodeCalls.Total, rep.NodeCalls.Failed, rep.NodeCalls.UnstageSkipped)
	if len(rep.AttacherErrors) > 0 {
		fmt.Fprintf(&b, "  errors seen by the attacher:\n")
		type kv struct {
			k string
			v int
		}
		var errs []kv
		for k, v := range rep.AttacherErrors {
			errs = append(errs, kv{k, v})
		}
		sort.Slice(errs, func(i, j int) bool { return errs[i].v > errs[j].v })
		for i, e := range errs {
			if i == 10 {
				fmt.Fprintf(&b, "    ... %d more\n", len(errs)-10)
				break
			}
			fmt.Fprintf(&b, "    %4dx %s\n", e.v, e.k)
		}
	}
	if len(rep.WorkloadFailures) > 0 {
		fmt.Fprintf(&b, "  the workload did not run as the scenario asks:\n")
		for _, f := range rep.WorkloadFailures {
			fmt.Fprintf(&b, "    - %s\n", f)
		}
	}
	fmt.Fprintf(&b, "  stuck: %d; invariant violations: %d\n", rep.Stuck, len(rep.InvariantViolations))
	for i, v := range rep.InvariantViolations {
		if i == 20 {
			fmt.Fprintf(&b, "    ... %d more in report.json\n", len(rep.InvariantViolations)-20)
			break
		}
		fmt.Fprintf(&b, "    - %s\n", strings.ReplaceAll(v.String(), "\n", "\n      "))
	}
	fmt.Fprintf(&b, "  run directory: %s (report.json, summary.txt, latency.svg, logs/)\n", rep.RunDir)
	return b.String()
}

// hostStats are the simulator's request counters; on KubeVirt's real
// control plane nothing counts the driver's requests, so they are empty.
func (r *run) hostStats() kubevirtsim.Stats {
	if r.h.Sim == nil {
		return kubevirtsim.Stats{}
	}
	return r.h.Sim.Stats()
}

// writeHostFaults lists the host faults played, each from its start (time
// into the run) for as long as it lasted.
func writeFaults(b *strings.Builder, title string, started time.Time, evs []FaultEvent) {
	if len(evs) == 0 {
		return
	}
	fmt.Fprintf(b, "  %s: %d\n", title, len(evs))
	for i, e := range evs {
		if i == 20 {
			fmt.Fprintf(b, "    ... %d more in report.json\n", len(evs)-20)
			return
		}
		lasted := "until the end of the run"
		if !e.End.IsZero() {
			lasted = "for " + e.End.Sub(e.Start).Round(100*time.Millisecond).String()
		}
		fmt.Fprintf(b, "    - %s on %s at +%s, %s\n", e.Fault, e.Target, e.Start.Sub(started).Round(time.Second), lasted)
	}
}

// writeByCase prints the latency of each case of one operation.
func writeByCase(b *strings.Builder, op string, cases []CaseLatency) {
	if len(cases) == 0 {
		return
	}
	fmt.Fprintf(b, "  %s latency by where the host had the volume when it started:\n", op)
	for _, c := range cases {
		p := c.Latency
		fmt.Fprintf(b, "    %-26s %4d (%3.0f%%)  p50 %6.1fs  p95 %6.1fs  p99 %6.1fs\n", c.Title+":", c.Count, 100*c.Share, p.P50, p.P95, p.P99)
	}
}
