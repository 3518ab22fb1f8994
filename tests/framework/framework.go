// Package framework starts what the integration, sanity and benchmark suites
// run against: a real kube-apiserver with the KubeVirt simulator (the host
// cluster) and the driver's controller service on a unix socket.
package framework

import (
	"context"
	"errors"
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
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Host is a simulated Harvester cluster: a real API server, the KubeVirt
// simulator and a namespace for the guest cluster's VMs.
type Host struct {
	Env       *testenv.Env
	Sim       *kubevirtsim.Sim
	Namespace string
	Kube      kubernetes.Interface
}

// StartHost starts a host cluster; it is stopped when tb ends.
func StartHost(tb testing.TB, opts kubevirtsim.Options) *Host {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	env, err := testenv.Start(ctx, testenv.Options{})
	if err != nil {
		tb.Fatalf("start control plane: %v", err)
	}
	tb.Cleanup(env.Stop)
	if opts.Namespace == "" {
		opts.Namespace = "guests"
	}
	kube := kubernetes.NewForConfigOrDie(env.Config)
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: opts.Namespace}}, metav1.CreateOptions{}); err != nil {
		tb.Fatalf("create namespace: %v", err)
	}
	sim, err := kubevirtsim.New(env.Config, opts)
	if err != nil {
		tb.Fatalf("simulator: %v", err)
	}
	if err := sim.Start(context.Background()); err != nil {
		tb.Fatalf("start simulator: %v", err)
	}
	tb.Cleanup(sim.Stop)
	return &Host{Env: env, Sim: sim, Namespace: opts.Namespace, Kube: kube}
}

// CreateVMs creates running VMs (guest nodes) and waits for their VMIs.
func (h *Host) CreateVMs(tb testing.TB, names ...string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, len(names))
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = h.Sim.CreateVM(ctx, kubevirtsim.VMSpec{Namespace: h.Namespace, Name: n})
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		tb.Fatalf("create VMs: %v", err)
	}
}

// CreateVolumes creates bound host PVCs named prefix-00, prefix-01, ...
func (h *Host) CreateVolumes(tb testing.TB, prefix string, n int) []string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	names := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range names {
		names[i] = fmt.Sprintf("%s-%02d", prefix, i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = h.Sim.CreatePVC(ctx, h.Namespace, names[i], "1Gi", false)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
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
	// Config is the host identity the controller acts as; nil: the
	// simulator's admin. It must reach the simulator's front proxy.
	Config *rest.Config
	// Guest, when set, is the guest cluster's API server: the detach guard
	// (DetachGuardTimeout > 0) and, with NodeMonitor, the guest node
	// monitor run against it.
	Guest              *rest.Config
	DetachGuardTimeout time.Duration
	NodeMonitor        bool
	Monitor            guest.MonitorConfig
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
		cfg = h.Sim.ClientConfig()
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
		DetachGuardTimeout: opts.DetachGuardTimeout, NodeMonitor: opts.NodeMonitor, Monitor: opts.Monitor}
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

// StartHostWithDisks starts a host cluster whose hot-plugged disks are real
// loop devices: one sparse backing file per host PVC, sized from the PVC, and
// a by-id directory per VM (LoopDisks.ByIDDir("<namespace>/<vm>")).
func StartHostWithDisks(tb testing.TB, opts kubevirtsim.Options) (*Host, *loopdisk.LoopDisks) {
	tb.Helper()
	work := tb.TempDir()
	var h *Host
	disks, err := loopdisk.New(loopdisk.Options{
		BackingDir: filepath.Join(work, "backing"),
		ByIDRoot:   filepath.Join(work, "by-id"),
		Size: func(ctx context.Context, claim string) (int64, error) {
			pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, claim, metav1.GetOptions{})
			if err != nil {
				return 0, err
			}
			q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
			return q.Value(), nil
		},
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = disks.Close(context.Background()) })
	opts.DiskHook = disks
	h = StartHost(tb, opts)
	return h, disks
}
