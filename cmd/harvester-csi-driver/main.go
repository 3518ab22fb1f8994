// Command harvester-csi-driver is the Harvester CSI driver with a per-VM,
// serialized hotplug queue. Its flags are a superset of upstream's.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Stamped at build time with -ldflags "-X main.version=... -X main.commit=...".
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
	publishMargin                                  time.Duration
	metricsAddr                                    string
	guestKubeconfig                                string
	detachGuardTimeout                             time.Duration
	nodeMonitor                                    bool
	node                                           nodeFlags
	showVersion                                    bool
}

func parseFlags(args []string) (*options, error) {
	o := &options{queue: hotplug.DefaultConfig()}
	fs := flag.NewFlagSet("harvester-csi-driver", flag.ContinueOnError)
	fs.StringVar(&o.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint (unix:///path or tcp://host:port)")
	fs.StringVar(&o.nodeID, "nodeid", "", "node ID (the guest's VM name); discovered when empty")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "host (Harvester) kubeconfig; its context's namespace holds the guest VMs (default "+host.DefaultKubeconfig+")")
	fs.StringVar(&o.hostStorageClass, "host-storage-class", os.Getenv("HOST_STORAGE_CLASS"), "host storage class for new volumes [$HOST_STORAGE_CLASS]")
	fs.BoolVar(&o.debug, "debug", envBool("DEBUG"), "verbose logs [$DEBUG]")
	fs.StringVar(&o.mode, "mode", "all", "services to run: all, controller or node")
	fs.StringVar(&o.backend, "hotplug-backend", host.BackendAuto, "hotplug backend: auto, declarative or subresource")
	fs.DurationVar(&o.queue.BatchWindow, "batch-window", o.queue.BatchWindow, "how long the first hotplug request on an idle VM waits for more")
	fs.DurationVar(&o.queue.MaxHold, "max-hold", o.queue.MaxHold, "longest wait for a VM's previous hotplug change to settle before the next")
	fs.IntVar(&o.queue.Workers, "hotplug-workers", o.queue.Workers, "VMs worked on at once")
	fs.Float64Var(&o.queue.QPS, "hotplug-qps", o.queue.QPS, "token-bucket rate of hotplug retries across all VMs")
	fs.IntVar(&o.queue.Burst, "hotplug-burst", o.queue.Burst, "token-bucket burst of hotplug retries")
	fs.Float64Var(&o.kubeQPS, "kube-api-qps", 20, "host API client QPS")
	fs.IntVar(&o.kubeBurst, "kube-api-burst", 40, "host API client burst")
	fs.DurationVar(&o.publishMargin, "publish-margin", 2*time.Second, "time kept before the caller's deadline to answer a publish still in flight")
	fs.StringVar(&o.metricsAddr, "metrics-address", "", "serve Prometheus metrics on this address (empty: off)")
	fs.StringVar(&o.guestKubeconfig, "guest-kubeconfig", "", "guest cluster kubeconfig, for the detach guard and the guest node monitor (default: the pod's in-cluster configuration)")
	fs.DurationVar(&o.detachGuardTimeout, "detach-guard-timeout", guest.DefaultDetachGuardTimeout, "how long an unpublish waits while the guest Node still lists the volume in use before unplugging it anyway (0: never wait)")
	fs.BoolVar(&o.nodeMonitor, "node-monitor", true, "run the guest node monitor (elected; taints Nodes of stopped VMs out of service and releases their volumes)")
	o.node.register(fs)
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	klogFlags.VisitAll(func(f *flag.Flag) { fs.Var(f.Value, f.Name, f.Usage) })
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
	if o.debug {
		_ = klogFlags.Set("v", "4")
	}
	if o.detachGuardTimeout < 0 {
		return nil, fmt.Errorf("invalid --detach-guard-timeout %s: want 0 (off) or more", o.detachGuardTimeout)
	}
	return o, nil
}

func envBool(name string) bool {
	b, _ := strconv.ParseBool(os.Getenv(name))
	return b
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "harvester-csi-driver:", err)
		os.Exit(2)
	}
	if o.showVersion {
		fmt.Println(version, commit)
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger := klog.Background()
	ctx = klog.NewContext(ctx, logger)
	if err := run(ctx, o); err != nil {
		logger.Error(err, "driver stopped")
		klog.Flush()
		os.Exit(1)
	}
}

func run(ctx context.Context, o *options) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
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
			Options:            driver.ControllerOptions{HostStorageClass: o.hostStorageClass, PublishMargin: o.publishMargin},
			Metrics:            reg,
			Guest:              guestClient,
			DetachGuardTimeout: o.detachGuardTimeout,
			NodeMonitor:        o.nodeMonitor,
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
		srv := &http.Server{Addr: o.metricsAddr, Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 10 * time.Second}
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
