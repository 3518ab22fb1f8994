// Command harvester-csi-driver is the Harvester CSI driver with a per-VM,
// serialized hotplug queue. Its flags are a superset of upstream's.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/diagnose"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
)

// Stamped at build time with -ldflags "-X main.version=... -X main.commit=...";
// the Makefile takes the version from the VERSION file.
var (
	version = "dev"
	commit  = "unknown"
)

type options struct {
	endpoint, nodeID, kubeconfig, hostStorageClass string
	debug                                          bool
	mode, backend                                  string
	queue                                          hotplug.Config
	kubeQPS                                        float64
	kubeBurst                                      int
	publishMargin, publishWait                     time.Duration
	publishWaitCrowd                               int
	metricsAddr                                    string
	pprof                                          bool
	guestKubeconfig                                string
	detachGuardTimeout                             time.Duration
	nodeMonitor                                    bool
	orphans                                        bool
	orphanGrace                                    time.Duration
	node                                           nodeFlags
	showVersion                                    bool
	logFormat, verbosity                           string
}

// newFlagSet defines the command line into o. Of klog's many flags only the
// verbosity is offered (--v; --debug is --v=4): the rest are for programs
// that write log files, which a pod does not.
func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("harvester-csi-driver", flag.ContinueOnError)
	// The flag package would print the error and the whole usage on every
	// parse error; the caller prints one line instead.
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint (unix:///path or tcp://host:port)")
	fs.StringVar(&o.nodeID, "nodeid", "", "node ID (the guest's VM name); discovered when empty")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "host (Harvester) kubeconfig; its context's namespace holds the guest VMs. "+
		"When the file does not exist, "+host.DefaultKubeconfig+" is used, as upstream")
	fs.StringVar(&o.hostStorageClass, "host-storage-class", os.Getenv("HOST_STORAGE_CLASS"), "host storage class for new volumes [$HOST_STORAGE_CLASS]")
	fs.BoolVar(&o.debug, "debug", envBool("DEBUG"), "verbose logs, the same as --v=4 [$DEBUG]")
	fs.StringVar(&o.mode, "mode", "all", "services to run: all, controller or node")
	fs.StringVar(&o.backend, "hotplug-backend", kubevirt.BackendAuto, "hotplug backend: auto, declarative or subresource")
	fs.DurationVar(&o.queue.BatchWindow, "batch-window", o.queue.BatchWindow, "how long the first hotplug request on an idle VM waits for more")
	fs.DurationVar(&o.queue.MaxHold, "max-hold", o.queue.MaxHold, "longest wait for a VM's previous hotplug change to settle before the next")
	fs.DurationVar(&o.queue.JoinWindow, "join-window", o.queue.JoinWindow, "how long after a VM's write adds may still join the attachment pod KubeVirt is starting for it (once per cycle; 0 turns it off)")
	fs.DurationVar(&o.queue.WedgedAfter, "wedged-after", o.queue.WedgedAfter, "how long a hotplug may wait on KubeVirt with no progress of the volume or its VM before the VM is reported wedged (Event, metric, the caller's answer)")
	fs.BoolVar(&o.queue.Strategy.OneRemovalAtATime, "one-removal-at-a-time", o.queue.Strategy.OneRemovalAtATime, "while a VM is paused on an I/O error (a device may be gone), write at most one removal of a mounted volume of it at a time, so virt-handler's remount of removed volumes cannot deadlock (every KubeVirt up to v1.9.0; turn off only on a KubeVirt with kubevirt PR 18044)")
	fs.IntVar(&o.queue.Workers, "hotplug-workers", o.queue.Workers, "VMs worked on at once")
	fs.Float64Var(&o.queue.QPS, "hotplug-qps", o.queue.QPS, "token-bucket rate of hotplug retries across all VMs (first attempts are not limited)")
	fs.IntVar(&o.queue.Burst, "hotplug-burst", o.queue.Burst, "token-bucket burst of hotplug retries")
	fs.Float64Var(&o.kubeQPS, "kube-api-qps", 20, "host API client QPS")
	fs.IntVar(&o.kubeBurst, "kube-api-burst", 40, "host API client burst")
	fs.DurationVar(&o.publishMargin, "publish-margin", 2*time.Second, "time kept before the caller's deadline to answer a publish still in flight")
	fs.DurationVar(&o.publishWait, "publish-wait", driver.DefaultPublishWait, "longest a publish or unpublish waits for KubeVirt, while --publish-wait-crowd calls wait at once, before answering \"in progress\" for the caller to retry (0: up to the caller's deadline)")
	fs.IntVar(&o.publishWaitCrowd, "publish-wait-crowd", driver.DefaultPublishWaitCrowd, "how many publishes and unpublishes waiting at once make each of them answer after --publish-wait; fewer, and the retry of a call answered so, wait up to the caller's deadline (1: always after --publish-wait)")
	fs.StringVar(&o.metricsAddr, "metrics-address", "", "serve Prometheus metrics, and the hotplug queue's state at "+diagnose.StatePath+", on this address (empty: off)")
	fs.BoolVar(&o.pprof, "enable-pprof", false, "also serve Go's profiles at /debug/pprof/ on --metrics-address")
	fs.StringVar(&o.guestKubeconfig, "guest-kubeconfig", "", "guest cluster kubeconfig, for the detach guard and the guest node monitor (default: the pod's in-cluster configuration)")
	fs.DurationVar(&o.detachGuardTimeout, "detach-guard-timeout", guest.DefaultDetachGuardTimeout, "how long an unpublish waits while the guest Node still lists the volume in use before unplugging it anyway (0: never wait)")
	fs.BoolVar(&o.nodeMonitor, "node-monitor", true, "run the guest node monitor (elected; taints Nodes of stopped VMs out of service and releases their volumes)")
	fs.BoolVar(&o.orphans, "orphan-reconciler", true, "remove volumes of this guest cluster hot-plugged into its VMs that no VolumeAttachment asks for (elected with the node monitor; never while the guest may have them mounted)")
	fs.DurationVar(&o.orphanGrace, "orphan-grace", guest.DefaultOrphanGrace, "how long a hot-plug no VolumeAttachment asks for is left before the orphan reconciler removes it")
	o.node.register(fs)
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	fs.Var(klogFlags.Lookup("v").Value, "v", "log verbosity (0-10)")
	fs.StringVar(&o.logFormat, "logging-format", logFormatText, "log format: text (klog) or json (as Kubernetes' components write it)")
	return fs
}

func parseFlags(args []string) (*options, error) {
	o := &options{queue: hotplug.DefaultConfig()}
	fs := newFlagSet(o)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	switch o.mode {
	case "all", "controller", "node":
	default:
		return nil, fmt.Errorf("invalid --mode %q: want all, controller or node", o.mode)
	}
	// Checked here, not when the backend is built: that happens only after
	// the host kubeconfig loaded and the host API answered.
	switch o.backend {
	case kubevirt.BackendAuto, kubevirt.BackendDeclarative, kubevirt.BackendSubresource:
	default:
		return nil, fmt.Errorf("invalid --hotplug-backend %q: want %s, %s or %s", o.backend, kubevirt.BackendAuto, kubevirt.BackendDeclarative, kubevirt.BackendSubresource)
	}
	explicitV := false
	fs.Visit(func(f *flag.Flag) { explicitV = explicitV || f.Name == "v" })
	if o.debug && !explicitV {
		_ = fs.Set("v", "4")
	}
	o.verbosity = fs.Lookup("v").Value.String()
	if err := validLogFormat(o.logFormat); err != nil {
		return nil, err
	}
	if o.detachGuardTimeout < 0 {
		return nil, fmt.Errorf("invalid --detach-guard-timeout %s: want 0 (off) or more", o.detachGuardTimeout)
	}
	if o.orphanGrace <= 0 {
		return nil, fmt.Errorf("invalid --orphan-grace %s: want more than 0 (turn the reconciler off with --orphan-reconciler=false)", o.orphanGrace)
	}
	if o.queue.Strategy != hotplug.AutoStrategy() {
		o.queue.Strategy.Name = "operator"
	}
	if o.queue.WedgedAfter <= 0 {
		return nil, fmt.Errorf("invalid --wedged-after %s: want more than 0", o.queue.WedgedAfter)
	}
	if o.publishWait < 0 {
		return nil, fmt.Errorf("invalid --publish-wait %s: want 0 (up to the caller's deadline) or more", o.publishWait)
	}
	if o.publishWaitCrowd < 1 {
		return nil, fmt.Errorf("invalid --publish-wait-crowd %d: want 1 (always answer after --publish-wait) or more", o.publishWaitCrowd)
	}
	return o, nil
}

// printUsage lists the flags the way they are written on a command line
// (--name), with their defaults.
func printUsage(w io.Writer) {
	fs := newFlagSet(&options{queue: hotplug.DefaultConfig()})
	fmt.Fprintf(w, "Usage: harvester-csi-driver [flags]\n\nCSI driver for Kubernetes guest clusters on Harvester, with a per-VM hotplug queue.\n\nFlags:\n")
	fs.VisitAll(func(f *flag.Flag) {
		kind, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if kind != "" {
			line += " " + kind
		}
		if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" {
			usage += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(w, "%s\n      %s\n", line, usage)
	})
}

// printVersion prints what the binary is, one labeled value a line.
func printVersion(w io.Writer) {
	fmt.Fprintf(w, "version: %s\ncommit: %s\ngo: %s\nplatform: %s/%s\n", version, buildCommit(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

// buildCommit is the stamped commit or, for a plain `go build` in a git
// checkout, the revision Go recorded.
func buildCommit() string {
	if commit != "unknown" {
		return commit
	}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return commit
	}
	rev, dirty := "", false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return commit
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if dirty {
		rev += "-dirty"
	}
	return rev
}

// parseCommandLine deals with everything that ends the process before the
// driver starts: --help, --version and a bad command line (one short line on
// stderr). It returns nil options and the exit code in those cases.
func parseCommandLine(args []string, stdout, stderr io.Writer) (*options, int) {
	o, err := parseFlags(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		printUsage(stdout)
		return nil, 0
	case err != nil:
		fmt.Fprintf(stderr, "harvester-csi-driver: %v\nRun 'harvester-csi-driver --help' for the list of flags.\n", err)
		return nil, 2
	case o.showVersion:
		printVersion(stdout)
		return nil, 0
	}
	return o, 0
}

// hostKubeconfig resolves --kubeconfig as the driver will load it (falling
// back to fallback when the file does not exist) and logs the file used. On
// failure it leaves the flag as given: a node plugin with --nodeid needs no
// host access, and the loading step reports the error where it is needed.
func hostKubeconfig(ctx context.Context, given, fallback string) string {
	logger := klog.FromContext(ctx)
	path, fellBack, err := host.ResolveKubeconfig(given, fallback)
	switch {
	case err != nil:
		logger.Info("No host kubeconfig found", "reason", err.Error())
		return given
	case fellBack && given != "":
		logger.Info("The --kubeconfig file does not exist: using the fallback host kubeconfig", "kubeconfig", given, "file", path)
	default:
		logger.Info("Host kubeconfig", "file", path)
	}
	return path
}

func envBool(name string) bool {
	b, _ := strconv.ParseBool(os.Getenv(name))
	return b
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "diagnose" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := runDiagnose(ctx, os.Args[2:], podEnv(), os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	o, code := parseCommandLine(os.Args[1:], os.Stdout, os.Stderr)
	if o == nil {
		os.Exit(code)
	}
	if err := applyLogging(o.logFormat, o.verbosity); err != nil {
		fmt.Fprintln(os.Stderr, "harvester-csi-driver:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger := klog.Background()
	ctx = klog.NewContext(ctx, logger)
	logger.Info("Starting harvester-csi-driver", "version", version, "commit", buildCommit(), "mode", o.mode)
	o.kubeconfig = hostKubeconfig(ctx, o.kubeconfig, host.DefaultKubeconfig)
	if err := run(ctx, o); err != nil {
		logger.Error(err, "driver stopped")
		klog.Flush()
		os.Exit(1)
	}
}

// debugMux serves the metrics, the hotplug queue's state (controller) and,
// when asked for, Go's profiles.
func debugMux(reg *prometheus.Registry, controller *driver.Controller, profiles bool) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/", promhttp.HandlerFor(reg, promhttp.HandlerOpts{})) // as before: metrics on every path
	if controller != nil {
		mux.Handle(diagnose.StatePath, diagnose.StateHandler(func() []hotplug.VMState {
			if q := controller.Queue(); q != nil {
				return q.State()
			}
			return nil
		}))
	}
	if profiles {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

func run(ctx context.Context, o *options) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildInfo(version, commit))
	g, ctx := errgroup.WithContext(ctx)

	var controller *driver.Controller
	var node csi.NodeServer
	var hostClient *host.Client
	if o.mode != "node" || o.nodeID == "" {
		c, err := host.Load(o.kubeconfig, float32(o.kubeQPS), o.kubeBurst)
		if err != nil {
			return err
		}
		hostClient = c
	}
	hostServer := ""
	if hostClient != nil {
		hostServer = serverHostPort(hostClient.Config.Host)
		reg.MustRegister(newTokenExpiry(hostClient.TokenExpiry))
	}
	if err := registerAPIRequests(reg, hostServer); err != nil {
		return err
	}
	if o.mode != "node" {
		guestClient, err := guest.Load(o.guestKubeconfig, float32(o.kubeQPS), o.kubeBurst)
		if err != nil {
			// Controller.Run says loudly what is off without it.
			klog.FromContext(ctx).Error(err, "no guest cluster client")
			guestClient = nil
		}
		controller = driver.NewController(driver.ControllerConfig{
			Host:               hostClient,
			Backend:            o.backend,
			Queue:              o.queue,
			Options:            driver.ControllerOptions{HostStorageClass: o.hostStorageClass, PublishMargin: o.publishMargin, PublishWait: o.publishWait, PublishWaitCrowd: o.publishWaitCrowd},
			Metrics:            reg,
			Guest:              guestClient,
			DetachGuardTimeout: o.detachGuardTimeout,
			NodeMonitor:        o.nodeMonitor,
			Orphans:            o.orphans,
			Orphan:             guest.OrphanConfig{Grace: o.orphanGrace},
		})
		g.Go(func() error { return controller.Run(ctx) })
	}
	if o.mode != "controller" {
		n, err := o.node.service(ctx, o, hostClient)
		if err != nil {
			return err
		}
		g.Go(func() error { n.Run(ctx); return nil })
		node = n
	}
	if o.metricsAddr != "" {
		srv := &http.Server{Addr: o.metricsAddr, Handler: debugMux(reg, controller, o.pprof), ReadHeaderTimeout: 10 * time.Second}
		g.Go(func() error {
			go func() { <-ctx.Done(); _ = srv.Close() }()
			if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		})
	}
	d := driver.New(version+" ("+commit+")", controller, node)
	g.Go(func() error { return d.Serve(ctx, o.endpoint) })
	return g.Wait()
}
