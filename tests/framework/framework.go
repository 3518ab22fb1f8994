// Package framework starts what the integration, sanity, e2e, rbac and
// benchmark suites run against: the simulated host cluster that
// internal/simhost builds (the lab's too), a guest API server, the driver's
// controller service on a unix socket, and driver processes.
package framework

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Host is a simulated Harvester cluster (internal/simhost): a real API
// server, the KubeVirt simulator and a namespace for the guest cluster's
// VMs.
type Host struct {
	*simhost.Host
}

// StartHost starts a host cluster; it is stopped when tb ends.
func StartHost(tb testing.TB, opts kubevirtsim.Options) *Host {
	tb.Helper()
	return startHost(tb, simhost.Options{Namespace: opts.Namespace, Sim: opts})
}

// StartHostWithDisks starts a host cluster whose hot-plugged disks are real
// loop devices: one sparse backing file per host PVC, sized from the PVC, and
// a by-id directory per VM (LoopDisks.ByIDDir("<namespace>/<vm>")).
func StartHostWithDisks(tb testing.TB, opts kubevirtsim.Options) (*Host, *loopdisk.LoopDisks) {
	tb.Helper()
	h := startHost(tb, simhost.Options{Namespace: opts.Namespace, Sim: opts, Disks: true})
	return h, h.Disks
}

// StartHostWith starts a host cluster built from o (KubeVirt's real control
// plane with o.Real); it is stopped when tb ends.
func StartHostWith(tb testing.TB, o simhost.Options) *Host {
	tb.Helper()
	return startHost(tb, o)
}

func startHost(tb testing.TB, o simhost.Options) *Host {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	h, err := simhost.Start(ctx, o)
	if err != nil {
		tb.Fatalf("start host: %v", err)
	}
	tb.Cleanup(func() {
		if err := h.Stop(context.Background()); err != nil {
			tb.Errorf("stop host: %v", err)
		}
	})
	return &Host{Host: h}
}

// CreateVMs creates running VMs (guest nodes) and waits for their VMIs.
func (h *Host) CreateVMs(tb testing.TB, names ...string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := h.Host.CreateVMs(ctx, names...); err != nil {
		tb.Fatalf("create VMs: %v", err)
	}
}

// CreateVolumes creates bound host PVCs named prefix-00, prefix-01, ...
func (h *Host) CreateVolumes(tb testing.TB, prefix string, n int) []string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	names, err := h.Host.CreateVolumes(ctx, prefix, n)
	if err != nil {
		tb.Fatalf("create host PVCs: %v", err)
	}
	return names
}

// ControllerOptions configure StartController.
type ControllerOptions struct {
	// Backend is auto, declarative or subresource.
	Backend string
	Queue   hotplug.Config
	Driver  driver.ControllerOptions
	// Node, when set, is served beside the controller (sanity needs both).
	Node csi.NodeServer
	// InformerLag delays every watch event the controller's informers get;
	// its live reads and writes are not delayed.
	InformerLag time.Duration
	// Config is the host identity the controller acts as; nil: the host's
	// admin (Host.ClientConfig). On the simulator it must reach its front
	// proxy.
	Config *rest.Config
	// Guest, when set, is the guest cluster's API server: the detach guard
	// (DetachGuardTimeout > 0) and, with NodeMonitor, the guest node
	// monitor run against it.
	Guest              *rest.Config
	DetachGuardTimeout time.Duration
	NodeMonitor        bool
	Monitor            guest.MonitorConfig
	// Orphans runs the orphan reconciler (elected with the node monitor).
	Orphans bool
	Orphan  guest.OrphanConfig
}

// Controller is a running controller service.
type Controller struct {
	Endpoint string
	Conn     *grpc.ClientConn
	Client   csi.ControllerClient
	Queue    *hotplug.Queue
	Metrics  *prometheus.Registry
	// Driver is the controller side itself (its guest node monitor, say).
	Driver *driver.Controller
	cancel context.CancelFunc
	done   chan struct{}
}

// StartController runs the driver's controller service (and identity) over
// the simulator's front proxy, as the chart's controller pod does. Stop ends
// it; tb's end stops it too.
func (h *Host) StartController(tb testing.TB, opts ControllerOptions) *Controller {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cfg := opts.Config
	if cfg == nil {
		cfg = h.ClientConfig()
	}
	if opts.InformerLag > 0 {
		cfg = withInformerLag(tb, cfg, opts.InformerLag)
	}
	hc, err := host.NewForConfig(cfg, h.Namespace)
	if err != nil {
		tb.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	cc := driver.ControllerConfig{Host: hc, Backend: opts.Backend, Queue: opts.Queue, Options: opts.Driver, Metrics: reg,
		DetachGuardTimeout: opts.DetachGuardTimeout, NodeMonitor: opts.NodeMonitor, Monitor: opts.Monitor,
		Orphans: opts.Orphans, Orphan: opts.Orphan}
	if opts.Guest != nil {
		if cc.Guest, err = kubernetes.NewForConfig(opts.Guest); err != nil {
			tb.Fatal(err)
		}
	}
	ctrl := driver.NewController(cc)
	dir, err := os.MkdirTemp("", "hcsi-") // unix socket paths must stay short
	if err != nil {
		tb.Fatal(err)
	}
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	d := driver.New("test", ctrl, opts.Node)
	c := &Controller{Endpoint: endpoint, Metrics: reg, Driver: ctrl, cancel: cancel, done: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = ctrl.Run(ctx) }()
	go func() { defer wg.Done(); _ = d.Serve(ctx, endpoint) }()
	go func() { wg.Wait(); os.RemoveAll(dir); close(c.done) }()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	c.Conn, c.Client = conn, csi.NewControllerClient(conn)
	// Wait until the socket answers and Probe says ready (informers synced),
	// as the sidecars do.
	up, cancelUp := context.WithTimeout(ctx, 30*time.Second)
	defer cancelUp()
	testwait.Until(up, tb, "the controller to come up", func() (bool, string) {
		probeCtx, pc := context.WithTimeout(up, time.Second)
		resp, err := csi.NewIdentityClient(conn).Probe(probeCtx, &csi.ProbeRequest{})
		pc()
		return err == nil && resp.GetReady().GetValue(), fmt.Sprintf("probe: %v (ready: %v)", err, ctrl.Ready())
	})
	c.Queue = ctrl.Queue()
	tb.Cleanup(c.Stop)
	return c
}

// WaitQueued returns once n intents are queued for vm, read from the queue's
// depth gauge as an operator would, so a test can act while they are pending.
func (c *Controller) WaitQueued(tb testing.TB, vm string, n int) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Every 5 ms: the test acts while the intents wait in their batch window.
	testwait.UntilEvery(ctx, tb, 5*time.Millisecond, fmt.Sprintf("%d intents queued on %s", n, vm), func() (bool, string) {
		got := 0.0
		families, err := c.Metrics.Gather()
		if err != nil {
			tb.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() != "harvester_csi_hotplug_queue_depth" {
				continue
			}
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "vm" && l.GetValue() == vm {
						got = m.GetGauge().GetValue()
					}
				}
			}
		}
		return got >= float64(n), fmt.Sprintf("%v queued", got)
	})
}

// Stop ends the controller as a crash or a rolling update would: in-flight
// calls are cut off and nothing is flushed.
func (c *Controller) Stop() {
	c.cancel()
	<-c.done
	_ = c.Conn.Close()
}
