// Command hcsi-lab is the local Harvester-in-a-box lab (`make lab`): it runs
// the CronJob churn of Harvester issue 9761 against a simulated Harvester and
// a real guest control plane with this driver as separate processes, checks
// the invariants, and writes a report. See docs/lab.md.
//
//	hcsi-lab [flags]               run the lab (as root)
//	hcsi-lab agent db|backup ...   the workload's container process (run by the lab's kubelets)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest/chart"
)

// minStuckBound is the shortest default stuck bound. Kubernetes' own
// recovery times do not follow --time-scale: the attach/detach controller
// waits up to 2 min for a VolumeAttachment it found already there (one still
// being deleted after a detach, say) before it creates a new one, and backs
// off failed operations up to 2m2s. A bound below that would call
// Kubernetes' own recovery stuck (a --quick run with the controller-kill
// fault saw a pod wait 2m1s that way, the driver answering every call at
// once).
const minStuckBound = 3 * time.Minute

// defaultHostNodes is --host-nodes when not given, for the default scenario
// and --quick alike: a small Harvester cluster's three host nodes, so that
// every run measures a hot-plug with the host's scheduling, Longhorn attach
// and kubelet publish in it, as on a real Harvester, instead of the kubelet
// stand-in's flat attachment-pod start. --quick too: on host nodes it ran in
// 3.5 to 5.3 minutes on the 2-core CI machine against 3.2 on the stand-in
// (docs/lab.md), a couple of minutes more for make test's TestQuickLab,
// and the CI preset then checks what make lab runs.
const defaultHostNodes = 3

// inNamespace marks the re-executed lab inside its private mount namespace.
const inNamespace = "HCSI_LAB_IN_MOUNT_NS"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "agent" {
		os.Exit(agentMain(os.Args[2:]))
	}
	os.Exit(labMain(os.Args[1:]))
}

// usage says what the lab is before its flags.
const usage = `hcsi-lab: the harvester-csi-driver lab, a Harvester in a box on this machine.

It starts a simulated Harvester host (a real kube-apiserver with a KubeVirt simulator whose hot-plugged
disks are real loop devices) and a real guest cluster (kube-apiserver, controller-manager, scheduler,
one real kubelet per guest node, the CSI sidecars and this driver as separate processes), then runs the
workload that deadlocked the upstream driver in the field (Harvester issue 9761: databases and backup
CronJobs in many namespaces), with optional faults. It checks the invariants (one RWO volume in one VM,
nothing stuck, every byte written read back) all the time and at the end, and writes report.json,
summary.txt, latency.svg and every component's log into the run directory. Exit status: 0 passed,
1 failed, 2 could not run. Needs root (loop devices, mounts, mkfs). docs/lab.md has the details.

Usage: hcsi-lab [flags]    (make lab LAB_FLAGS="...")

`

type flags struct {
	cfg                  lab.Config
	quick                bool
	compare              string
	pauseFor, pauseEvery time.Duration
	verbosity            int
	real                 bool
	set                  map[string]bool
}

func parse(args []string, out io.Writer) (*flags, error) {
	f := &flags{set: map[string]bool{}}
	c := &f.cfg
	fs := flag.NewFlagSet("hcsi-lab", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	fs.BoolVar(&f.quick, "quick", false, "the CI preset: 2 nodes, 6 namespaces, lab-made Jobs every few seconds, time scale 0.1, faults on")
	fs.Float64Var(&c.Minutes, "minutes", 8, "how long the workload runs (schedule minutes) before quiescing")
	fs.IntVar(&c.Namespaces, "namespaces", 40, "workload namespaces (a database StatefulSet and a backup CronJob each)")
	fs.IntVar(&c.Nodes, "nodes", 3, "guest nodes (VMs)")
	fs.StringVar(&c.KubeVirt, "kubevirt", lab.KubeVirtLegacyV15, "KubeVirt: a simulated version (v1.5.3, v1.6.3, v1.6.6, v1.7.0, v1.7.4, v1.8.2, main), optionally prefixed legacy- or declarative- (default: the hotplug Harvester ships it with), or "+lab.KubeVirtLegacyV15+" (Harvester 1.6), "+lab.KubeVirtLegacyV17+" (1.7), "+lab.KubeVirtDeclarative+" (1.8); "+lab.RealPrefix+"[legacy-|declarative-]TAG runs KubeVirt's own virt-controller and virt-api of a tag hack/tools.sh builds (v1.6.0, v1.7.0, v1.8.2, v1.8.4) instead")
	fs.StringVar(&c.Harvester, "harvester", "", "Harvester release `X.Y[.Z]` (1.6, 1.7.0, 1.7.2, 1.8.0, 1.8.2, 1.9; docs/lab.md): run the KubeVirt and hotplug mode it ships, simulated; with --kubevirt, both must agree")
	fs.BoolVar(&f.real, "real", false, "with --harvester: run the real KubeVirt control plane nearest to that release's (an error when none builds here)")
	fs.Float64Var(&c.TimeScale, "time-scale", 1, "multiplies the simulated real-world timings (0.1 = ten times faster)")
	fs.Uint64Var(&c.Seed, "seed", 1, "seed of every random choice")
	fs.StringVar(&c.Out, "out", "", "run directory `DIR` (default lab-runs/<time> in the working tree)")
	fs.StringVar(&c.ControllerBinary, "controller-binary", "", "run the binary at `PATH` as the controller process instead of the driver's (it takes upstream's flags)")
	fs.StringVar(&f.compare, "compare", "", "run the scenario twice, this driver then the controller binary at `PATH`, and compare")
	fs.StringVar(&c.DriverBinary, "driver-binary", "", "the driver binary `PATH` (default bin/harvester-csi-driver, which make lab builds)")
	fs.StringVar(&c.Manifests, "manifests", "", "the rendered chart (default deploy/harvester-csi-driver.yaml)")
	fs.DurationVar(&c.StuckBound, "stuck-bound", 0, "a pod or VolumeAttachment in progress longer than this is stuck (default 5m at time scale 1)")
	fs.DurationVar(&c.JobInterval, "job-interval", 0, "with lab-made Jobs (--quick), how often each namespace runs one")
	fs.DurationVar(&c.MoveInterval, "move-interval", 0, "how often a database is moved to another node (default 20s at time scale 1)")
	fs.DurationVar(&c.ExpandEvery, "expand-every", 0, "expand one database's claim by 512Mi (online, through the csi-resizer and the kubelet) this often, then move the database so it verifies its data (0: never)")
	fs.Float64Var(&c.SkipUnstage, "skip-unstage", 0, "fault: probability that a kubelet's NodeUnstageVolume never reaches the driver, as in kubelet's unstage race")
	fs.DurationVar(&c.ControllerKillEvery, "kill-controller-every", 0, "fault: SIGKILL the driver's controller process this often (it restarts)")
	fs.DurationVar(&f.pauseFor, "pause-api-for", 0, "fault: pause (SIGSTOP) the host API server for this long ...")
	fs.DurationVar(&f.pauseEvery, "pause-api-every", 0, "... this often")
	fs.DurationVar(&c.AttachPodStuck, "attachment-pod-stuck", 0, "fault: a VM's attachment pods stay unready for this long, now and then")
	fs.DurationVar(&c.AttachPodStuckEvery, "attachment-pod-stuck-every", 0, "how often the attachment-pod fault strikes (default 4x its length)")
	fs.BoolVar(&c.StuckDetachOnReadd, "stuck-detach-on-readd", false, "fault: a volume re-added while Detaching stays Detaching (KubeVirt before 1.8.2 does this by itself; the flag refuses a newer --kubevirt)")
	fs.Float64Var(&c.DenyHotplug, "deny-hotplug", 0, "fault: fraction of volumes a validating webhook denies hotplug for, a few seconds at a time")
	fs.DurationVar(&c.WebhookOutage, "webhook-outage", 0, "fault: Harvester's webhook service is away this long (every VM write fails calling it), now and then; needs --harvester")
	fs.DurationVar(&c.WebhookOutageEvery, "webhook-outage-every", 0, "how often the webhook outage strikes (default 4x its length)")
	fs.DurationVar(&c.LonghornFaulted, "longhorn-faulted", 0, "host fault: a random attached Longhorn volume is faulted for this long (detached at once, publish answers Aborted), now and then; needs --host-nodes")
	fs.DurationVar(&c.LonghornFaultedEvery, "longhorn-faulted-every", 0, "how often the Longhorn-faulted fault strikes (default 4x its length)")
	fs.DurationVar(&c.CordonHost, "cordon-host", 0, "host fault: a random VM's host node is cordoned (spec.unschedulable, as Harvester's maintenance mode starts) for this long, now and then; needs --host-nodes")
	fs.DurationVar(&c.CordonHostEvery, "cordon-host-every", 0, "how often the cordon fault strikes (default 4x its length)")
	fs.DurationVar(&c.SlowHostDetach, "slow-host-detach", 0, "host fault: Longhorn's detach takes ten times as long for this long, now and then; needs --host-nodes")
	fs.DurationVar(&c.SlowHostDetachEvery, "slow-host-detach-every", 0, "how often the slow-teardown fault strikes (default 4x its length)")
	fs.DurationVar(&c.GhostWorkload, "ghost-workload", 0, "host fault: a random attached Longhorn volume's workloads list keeps an entry of a pod long gone for this long, now and then; needs --host-nodes")
	fs.DurationVar(&c.GhostWorkloadEvery, "ghost-workload-every", 0, "how often the ghost-workload fault strikes (default 4x its length)")
	fs.DurationVar(&c.MigrateVMsEvery, "migrate-vms", 0, "fault: live-migrate every guest VM to another host node in turn, one at a time, this often (what a Harvester upgrade does)")
	fs.DurationVar(&c.DrainNodesEvery, "drain-nodes", 0, "fault: roll the guest nodes this often, one at a time: cordon, evict every pod a DaemonSet does not own, uncordon after the upgrade (what an RKE2 upgrade through Rancher does)")
	fs.IntVar(&c.HostNodes, "host-nodes", defaultHostNodes, "run the host storage path under each attachment pod on this many host nodes: real kubelets, scheduler, attach/detach controller and csi-attacher, and the Longhorn stand-in (on the simulated and the real control plane alike; 0: none, KubeVirt's pods run on a kubelet stand-in)")
	fs.IntVar(&f.verbosity, "v", 2, "log verbosity of the lab's own log (logs/lab.log)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
	if err := f.harvester(); err != nil {
		return nil, err
	}
	if f.quick {
		preset := map[string]func(){
			"nodes":                 func() { c.Nodes = 2 },
			"namespaces":            func() { c.Namespaces = 6 },
			"minutes":               func() { c.Minutes = 2 },
			"time-scale":            func() { c.TimeScale = 0.1 },
			"job-interval":          func() { c.JobInterval = 5 * time.Second },
			"move-interval":         func() { c.MoveInterval = 4 * time.Second },
			"stuck-bound":           func() { c.StuckBound = minStuckBound },
			"skip-unstage":          func() { c.SkipUnstage = 0.2 },
			"kill-controller-every": func() { c.ControllerKillEvery = 40 * time.Second },
			"expand-every":          func() { c.ExpandEvery = 15 * time.Second },
		}
		for name, apply := range preset {
			if !f.set[name] {
				apply()
			}
		}
		c.LabJobs = true
	}
	if c.Nodes < 1 || c.Namespaces < 1 || c.Minutes <= 0 || c.TimeScale <= 0 {
		return nil, errors.New("--nodes, --namespaces, --minutes and --time-scale must be positive")
	}
	if c.HostNodes < 0 {
		return nil, errors.New("--host-nodes must not be negative")
	}
	if c.HostNodes > 0 && c.AttachPodStuck > 0 {
		// The switch holds the simulator's kubelet stand-in, which stands
		// aside for the host nodes' real kubelets.
		return nil, errors.New("--attachment-pod-stuck needs the simulator's kubelet stand-in (add --host-nodes 0); on host nodes real kubelets run the attachment pods")
	}
	if err := c.CheckHostFaults(); err != nil {
		return nil, err
	}
	if c.StuckBound == 0 {
		c.StuckBound = max(minStuckBound, time.Duration(float64(5*time.Minute)*c.TimeScale))
	}
	if c.MoveInterval == 0 {
		c.MoveInterval = max(2*time.Second, time.Duration(float64(20*time.Second)*c.TimeScale))
	}
	if c.LabJobs && c.JobInterval == 0 {
		c.JobInterval = max(2*time.Second, time.Duration(float64(time.Minute)*c.TimeScale))
	}
	c.APIPause, c.APIPauseEvery = f.pauseFor, f.pauseEvery
	if (f.pauseFor > 0) != (f.pauseEvery > 0) {
		return nil, errors.New("--pause-api-for and --pause-api-every go together")
	}
	if err := checkoutDefaults(c); err != nil {
		return nil, err
	}
	var err error
	for _, p := range []*string{&c.Out, &c.DriverBinary, &c.Manifests, &c.ControllerBinary, &f.compare} {
		if *p != "" {
			if *p, err = filepath.Abs(*p); err != nil {
				return nil, err
			}
		}
	}
	for _, b := range []string{c.DriverBinary, c.ControllerBinary, f.compare} {
		if b == "" {
			continue
		}
		if st, err := os.Stat(b); err != nil || st.IsDir() {
			return nil, fmt.Errorf("binary %s: not found (run `make build` for the driver)", b)
		}
	}
	return f, nil
}

// harvester turns --harvester (and --real) into the --kubevirt it stands
// for.
func (f *flags) harvester() error {
	c := &f.cfg
	if c.Harvester == "" {
		if f.real {
			return fmt.Errorf("--real goes with --harvester (or give --kubevirt %sTAG)", lab.RealPrefix)
		}
		return nil
	}
	given := ""
	if f.set["kubevirt"] {
		given = c.KubeVirt
	}
	kv, err := lab.HarvesterKubeVirt(c.Harvester, f.real, given)
	if err != nil {
		return err
	}
	c.KubeVirt = kv
	return nil
}

// checkoutDefaults fills in the paths that default to the checkout's: the
// rendered chart, the driver binary make lab builds and the run directory.
func checkoutDefaults(c *lab.Config) error {
	if c.Manifests != "" && c.DriverBinary != "" && c.Out != "" {
		return nil
	}
	root, err := checkout.Root()
	if err != nil {
		return fmt.Errorf("%w; or give --manifests, --driver-binary and --out", err)
	}
	if c.Manifests == "" {
		c.Manifests = filepath.Join(root, chart.File)
	}
	if c.DriverBinary == "" {
		c.DriverBinary = filepath.Join(root, "bin", "harvester-csi-driver")
	}
	if c.Out == "" {
		c.Out = filepath.Join(root, "lab-runs", time.Now().Format("20060102-150405"))
	}
	return nil
}

func labMain(args []string) int {
	f, err := parse(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab:", err)
		return 2
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "hcsi-lab: the lab needs root (loop devices, mounts, mkfs)")
		return 2
	}
	if os.Getenv(inNamespace) == "" {
		return outside(f, args)
	}
	return inside(f)
}

// outside re-runs the lab in a private mount namespace, so every mount the
// lab's kubelets and drivers make disappears with it whatever happens, then
// detaches the loop devices the run left (those are global).
func outside(f *flags, args []string) int {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab:", err)
		return 2
	}
	// Fix the run directory here, so both sides agree on it.
	args = append(args, "--out="+f.cfg.Out)
	cmd := exec.Command(exe, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), inNamespace+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS}
	err = runForwardingSignals(cmd)
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
		if code < 0 {
			code = 1
		}
	case err != nil:
		fmt.Fprintln(os.Stderr, "hcsi-lab:", err)
		code = 2
	}
	if pids := lab.KillLeftovers(f.cfg.Out); len(pids) > 0 {
		fmt.Fprintf(os.Stderr, "hcsi-lab: killed %d processes the lab left running: %v\n", len(pids), pids)
		lab.WaitGone(pids, 10*time.Second) // they hold mounts and loop devices until they are gone
	}
	if err := lab.DetachLoopDevices(filepath.Join(f.cfg.Out, "host", "backing")); err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab: detaching loop devices:", err)
		code = max(code, 1)
	}
	return code
}

// runForwardingSignals runs cmd and passes it the interrupts and
// terminations this process gets, so that the lab stops, reports and cleans
// up whichever of the two a supervisor signals: a SIGTERM sent to this
// process alone (kill, a CI timeout) would otherwise never reach the lab, and
// a Ctrl-C that reaches both through the process group only repeats the
// request.
func runForwardingSignals(cmd *exec.Cmd) error {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			select {
			case s := <-sigs:
				_ = cmd.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	return cmd.Wait()
}

func inside(f *flags) int {
	// Mounts made in here must not propagate to the host's namespace.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab: private mount namespace:", err)
		return 2
	}
	c := &f.cfg
	if err := os.MkdirAll(filepath.Join(c.Out, "logs"), 0o750); err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab:", err)
		return 2
	}
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	_ = fs.Set("logtostderr", "false")
	_ = fs.Set("alsologtostderr", "false")
	_ = fs.Set("one_output", "true")
	_ = fs.Set("skip_log_headers", "true")
	_ = fs.Set("log_file", filepath.Join(c.Out, "logs", "lab.log"))
	_ = fs.Set("v", fmt.Sprint(f.verbosity))
	defer klog.Flush()

	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab:", err)
		return 2
	}
	c.AgentCommand = []string{exe, "agent"}
	c.PrivateMountNamespace = true
	c.Progress = os.Stdout
	if st, err := os.Stdout.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
		c.TTY = true
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx = klog.NewContext(ctx, klog.Background().WithName("lab"))

	if f.compare != "" {
		return compare(ctx, f)
	}
	fmt.Printf("hcsi-lab: run directory %s\n", c.Out)
	rep, err := lab.Run(ctx, *c)
	if err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab: the lab could not run:", err)
		if rep == nil {
			return 2
		}
	}
	if rep == nil {
		return 2
	}
	fmt.Print(rep.Summary())
	if !rep.Passed {
		return 1
	}
	return 0
}

// compare runs the same scenario and seed twice: this driver's controller,
// then the binary at --compare, and prints both side by side.
func compare(ctx context.Context, f *flags) int {
	base := f.cfg.Out
	var reps [2]*lab.Report
	for i, bin := range []string{"", f.compare} {
		c := f.cfg
		c.ControllerBinary = bin
		c.Out = filepath.Join(base, []string{"this-driver", "compared"}[i])
		fmt.Printf("hcsi-lab: run %d of 2 (%s) in %s\n", i+1, []string{"this driver", bin}[i], c.Out)
		rep, err := lab.Run(ctx, c)
		if err != nil {
			fmt.Fprintln(os.Stderr, "hcsi-lab:", err)
		}
		if rep == nil {
			return 2
		}
		reps[i] = rep
		if ctx.Err() != nil {
			break
		}
	}
	if reps[1] == nil {
		return 2
	}
	fmt.Print(lab.Compare(reps[0], reps[1]))
	if err := lab.WriteCompareSVG(filepath.Join(base, "compare.svg"), reps[0], reps[1]); err != nil {
		fmt.Fprintln(os.Stderr, "hcsi-lab: compare.svg:", err)
	} else {
		fmt.Printf("both runs in one figure: %s\n", filepath.Join(base, "compare.svg"))
	}
	if !reps[0].Passed {
		return 1
	}
	return 0
}
