package bench

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testmetrics"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

var (
	def       = DefaultChurn()
	vmsFlag   = flag.Int("churn.vms", def.VMs, "VMs (guest nodes)")
	volsFlag  = flag.Int("churn.volumes", def.Volumes, "volumes")
	wavesFlag = flag.Int("churn.waves", def.Waves, "waves")
	period    = flag.Duration("churn.period", def.Period, "time between waves (simulated)")
	sameVM    = flag.Float64("churn.same-vm", def.SameVM, "share of volumes landing on the VM they were on")
	timeout   = flag.Duration("churn.call-timeout", def.CallTimeout, "the attacher's --timeout (simulated)")
	deadline  = flag.Duration("churn.deadline", def.Deadline, "an operation not done after this is unfinished (simulated)")
	seed      = flag.Uint64("churn.seed", def.Seed, "seed of the plan")
	scale     = flag.Float64("churn.scale", def.Scale, "time scale (0.1: an 8 s attachment-pod start takes 0.8 s)")
	workers   = flag.String("churn.workers", "10,100", "attacher worker threads to run with (the attacher's default, the chart's)")
	pubWait   = flag.Duration("churn.publish-wait", driver.DefaultPublishWait, "the driver's --publish-wait (simulated; 0: up to the call's deadline)")
	pubCrowd  = flag.Int("churn.publish-wait-crowd", driver.DefaultPublishWaitCrowd, "the driver's --publish-wait-crowd")
	only      = flag.String("churn.flavor", "", "run only flavors whose name contains this")
	noJoin    = flag.Bool("churn.no-join", false, "the driver's --join-window=0: late adds never join the attachment pod KubeVirt is starting (to measure what the join changes)")
	oneRemove = flag.Bool("churn.one-removal-at-a-time", true, "the driver's --one-removal-at-a-time (false: the queue's strategy has no rule, to measure what the rule costs)")
	resultDir = flag.String("churn.results", "../../bench/results", "where the JSON results go")
)

// flavor is a KubeVirt the churn runs against.
type flavor struct {
	name    string
	mode    kubevirtsim.Mode
	version kubevirtsim.Version
}

// flavors are every KubeVirt version the simulator names, in each hotplug
// mode it has (declarative from v1.6 on); a later patch release of a line
// (v1.6.6, v1.7.4) only in the mode its Harvester release runs, as it
// differs from the line's first only in kubevirt PR 16159.
var flavors = []flavor{
	{"legacy-v1.5.3", kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3},
	{"legacy-v1.6.3", kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3},
	{"legacy-v1.6.6", kubevirtsim.ModeLegacy, kubevirtsim.V1_6_6},
	{"legacy-v1.7.0", kubevirtsim.ModeLegacy, kubevirtsim.V1_7_0},
	{"legacy-v1.8.2", kubevirtsim.ModeLegacy, kubevirtsim.V1_8_2},
	{"legacy-main", kubevirtsim.ModeLegacy, kubevirtsim.VMain},
	{"declarative-v1.6.3", kubevirtsim.ModeDeclarative, kubevirtsim.V1_6_3},
	{"declarative-v1.7.0", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0},
	{"declarative-v1.7.4", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_4},
	{"declarative-v1.8.2", kubevirtsim.ModeDeclarative, kubevirtsim.V1_8_2},
	{"declarative-main", kubevirtsim.ModeDeclarative, kubevirtsim.VMain},
}

// simHost adapts a framework host and controller to Host.
type simHost struct {
	h    *framework.Host
	ctrl *framework.Controller
	pods *podCounter // nil: not counted
	gens *generations
}

func (s simHost) Controller() csi.ControllerClient { return s.ctrl.Client }
func (s simHost) Reset() {
	s.h.Sim.ResetStats()
	if s.pods != nil {
		s.pods.reset()
	}
	if s.gens != nil {
		s.gens.start = s.gens.read()
	}
}
func (s simHost) Counts() (int, int, map[string]int) {
	st := s.h.Sim.Stats()
	reqs := map[string]int{}
	for k, n := range st.Requests {
		if k.Verb == "watch" {
			continue
		}
		name := k.Verb + " " + k.Resource
		if k.Subresource != "" {
			name += "/" + k.Subresource
		}
		reqs[name] += n
	}
	for k, codes := range st.Answers {
		if n := codes[409] + codes[422]; n > 0 {
			reqs["conflict "+k.Verb+" "+k.Resource+"/"+k.Subresource] += n
		}
	}
	c409, c422 := st.Contended()
	return st.VMSpecWrites + st.VMStatusWrites + st.VMIWrites + st.AddVolume + st.RemoveVolume, c409 + c422, reqs
}

// BenchmarkChurn runs the wave workload on every flavor with each worker
// setting and writes bench/results/churn-<flavor>-w<workers>.json.
//
//	make bench BENCH=churn
func BenchmarkChurn(b *testing.B) {
	match, err := flavorFlag(*harvesterFlag, "churn.flavor", *only, flagGiven("churn.flavor"))
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range flavors {
		if match != "" && !strings.Contains(f.name, match) {
			continue
		}
		for _, w := range strings.Split(*workers, ",") {
			var n int
			if _, err := fmt.Sscan(w, &n); err != nil || n <= 0 {
				b.Fatalf("bad -churn.workers %q", *workers)
			}
			b.Run(fmt.Sprintf("%s/workers=%d", f.name, n), func(b *testing.B) {
				cfg := DefaultChurn()
				cfg.VMs, cfg.Volumes, cfg.Waves, cfg.Period, cfg.SameVM = *vmsFlag, *volsFlag, *wavesFlag, *period, *sameVM
				cfg.CallTimeout, cfg.Deadline, cfg.Seed, cfg.Scale, cfg.Workers = *timeout, *deadline, *seed, *scale, n
				cfg.PublishWait, cfg.PublishWaitCrowd = *pubWait, *pubCrowd
				for range b.N {
					res := churnOnce(b, f, cfg)
					res.Name = fmt.Sprintf("churn-%s-w%d", f.name, n)
					if *pubWait != driver.DefaultPublishWait || *pubCrowd != driver.DefaultPublishWaitCrowd {
						res.Name += fmt.Sprintf("-wait%s-crowd%d", pubWait, *pubCrowd)
					}
					if !*oneRemove {
						res.Name += "-one-removal-off"
					}
					if *noJoin {
						res.Name += "-no-join"
					}
					path, err := res.Write(*resultDir)
					if err != nil {
						b.Fatal(err)
					}
					b.Logf("%s: %d/%d unfinished, publish p50 %.1fs p99 %.1fs, unpublish p99 %.1fs, %.2f VM writes/op, %.2f host requests/op, %d conflicts, %d batches, %d VM spec updates, %d attachment pods -> %s",
						res.Name, res.Unfinished, res.Operations, res.PublishToReady.P50, res.PublishToReady.P99, res.Unpublish.P99,
						res.VMWritesPerOperation, res.HostRequestsPerOp, res.Conflicts, res.DriverBatches, res.VMSpecUpdates, res.AttachmentPods, path)
					b.ReportMetric(float64(res.Unfinished), "unfinished")
					b.ReportMetric(res.PublishToReady.P99, "p99-publish-s")
					b.ReportMetric(res.VMWritesPerOperation, "vm-writes/op")
					b.ReportMetric(res.HostRequestsPerOp, "host-requests/op")
				}
			})
		}
	}
}

func churnOnce(b *testing.B, f flavor, cfg ChurnConfig) ChurnResult {
	b.Helper()
	h, vms, vols := startFleet(b, f, cfg.Scale, cfg.Seed, "node-%d", cfg.VMs, "churn", cfg.Volumes)
	queue := scaledQueue(cfg.Scale)
	if !*oneRemove {
		queue.Strategy = hotplug.Strategy{Name: "one-removal-off"}
	}
	if *noJoin {
		queue.JoinWindow = 0
	}
	ctrl := h.StartController(b, framework.ControllerOptions{Backend: kubevirt.BackendAuto,
		Queue: queue, Driver: scaledDriver(cfg.Scale, cfg.PublishWait, cfg.PublishWaitCrowd)})
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	pods := countAttachmentPods(ctx, b, h)
	gens := &generations{b: b, h: h}
	batchesBefore := gatherCounter(b, ctrl.Metrics, "harvester_csi_hotplug_vm_writes_total")
	res := RunChurn(ctx, simHost{h: h, ctrl: ctrl, pods: pods, gens: gens}, cfg, vms, vols)
	res.ControllerDescription = "this driver, backend " + ctrl.Queue.BackendName()
	res.DriverBatches = int(gatherCounter(b, ctrl.Metrics, "harvester_csi_hotplug_vm_writes_total") - batchesBefore)
	res.AttachmentPods = pods.count()
	for vm, g := range gens.read() {
		res.VMSpecUpdates += int(g - gens.start[vm])
	}
	return res
}

// generations reads every VM's metadata.generation, which the API server
// raises on each change of the VM's spec, whoever makes it (the driver's
// patch in declarative mode, KubeVirt's VM controller applying queued
// requests in legacy mode).
type generations struct {
	b     *testing.B
	h     *framework.Host
	start map[string]int64
}

func (g *generations) read() map[string]int64 {
	dyn, err := dynamic.NewForConfig(g.h.Env.Config)
	if err != nil {
		g.b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l, err := dyn.Resource(schema.GroupVersionResource{Group: "kubevirt.io", Version: "v1", Resource: "virtualmachines"}).
		Namespace(g.h.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		g.b.Fatal(err)
	}
	out := map[string]int64{}
	for _, vm := range l.Items {
		out[vm.GetName()] = vm.GetGeneration()
	}
	return out
}

// podCounter counts the attachment pods KubeVirt creates on the host.
type podCounter struct {
	mu sync.Mutex
	n  int
}

func (p *podCounter) reset() { p.mu.Lock(); p.n = 0; p.mu.Unlock() }
func (p *podCounter) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

func countAttachmentPods(ctx context.Context, b *testing.B, h *framework.Host) *podCounter {
	b.Helper()
	pc := &podCounter{}
	f := informers.NewSharedInformerFactoryWithOptions(h.Kube, 0, informers.WithNamespace(h.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = "kubevirt.io=hotplug-disk" }))
	inf := f.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: func(any) {
		pc.mu.Lock()
		pc.n++
		pc.mu.Unlock()
	}}); err != nil {
		b.Fatal(err)
	}
	f.Start(ctx.Done())
	f.WaitForCacheSync(ctx.Done())
	return pc
}

// gatherCounter sums a counter's series in reg.
func gatherCounter(b *testing.B, reg prometheus.Gatherer, name string) float64 {
	b.Helper()
	v, _ := testmetrics.Value(b, reg, name, nil)
	return v
}

// startFleet starts a simulated host of flavor f with vmCount running VMs
// named by vmFormat (fmt, given the index) and volCount volumes named from
// volPrefix: what a workload moves its volumes between.
func startFleet(b *testing.B, f flavor, scale float64, seed uint64, vmFormat string, vmCount int, volPrefix string, volCount int) (*framework.Host, []string, []string) {
	b.Helper()
	h := framework.StartHost(b, kubevirtsimOptions(f, scale, seed))
	vms := make([]string, vmCount)
	for i := range vms {
		vms[i] = fmt.Sprintf(vmFormat, i)
	}
	h.CreateVMs(b, vms...)
	return h, vms, h.CreateVolumes(b, volPrefix, volCount)
}

func kubevirtsimOptions(f flavor, scale float64, seed uint64) kubevirtsim.Options {
	return kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: scale, BindClasslessPVCs: true, Seed: seed}
}

// scaledQueue is the queue's default configuration with its timings (and
// retry rate) scaled like the simulator's latencies.
func scaledQueue(scale float64) hotplug.Config {
	sc := func(d time.Duration) time.Duration { return time.Duration(float64(d) * scale) }
	d := hotplug.DefaultConfig()
	return hotplug.Config{BatchWindow: sc(d.BatchWindow), MaxHold: sc(d.MaxHold), JoinWindow: sc(d.JoinWindow), BackoffBase: sc(d.BackoffBase), BackoffMax: sc(d.BackoffMax),
		QPS: d.QPS / scale, Burst: d.Burst, Workers: d.Workers}
}

func scaledDriver(scale float64, publishWait time.Duration, crowd int) driver.ControllerOptions {
	sc := func(d time.Duration) time.Duration { return time.Duration(float64(d) * scale) }
	return driver.ControllerOptions{PublishMargin: sc(2 * time.Second), PublishWait: sc(publishWait), PublishWaitCrowd: crowd}
}
