package bench

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/harvester-csi/harvester-csi-driver/internal/proc"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

var (
	defScale       = DefaultScale()
	scaleVMs       = flag.Int("scale.vms", defScale.VMs, "VMs (guest nodes)")
	scaleVols      = flag.Int("scale.volumes", defScale.Volumes, "volumes, all attached")
	scaleChurn     = flag.Float64("scale.churn", defScale.ChurnPerMinute, "share of the volumes moved per simulated minute")
	scaleSameVM    = flag.Float64("scale.same-vm", defScale.SameVM, "share of moves back to the same VM")
	scaleWarmup    = flag.Duration("scale.warmup", defScale.Warmup, "churn before the steady state is measured (simulated)")
	scaleDuration  = flag.Duration("scale.duration", defScale.Duration, "steady state measured (simulated)")
	scaleWorkers   = flag.Int("scale.workers", defScale.Workers, "attacher worker threads")
	scaleTime      = flag.Float64("scale.scale", defScale.Scale, "time scale (0.5: an hour takes 30 minutes)")
	scaleSeed      = flag.Uint64("scale.seed", defScale.Seed, "seed of the plan")
	scaleFlavor    = flag.String("scale.flavor", "declarative-v1.7.0", "KubeVirt to run against (a churn flavor name)")
	scalePubWait   = flag.Duration("scale.publish-wait", 0, "the driver's --publish-wait (simulated), a plain bound (--publish-wait-crowd=1)")
	scaleBinary    = flag.String("scale.binary", "", "driver binary to run as the controller (default: built from this tree)")
	scaleDense     = flag.Int("scale.dense", 0, "the dense shape: this many of -scale.volumes on one more VM, churned on it (200 for the issue's)")
	scaleDenseDL   = flag.Duration("scale.dense-deadline", defScale.DenseDeadline, "bound of each dense-VM operation and of its initial attach (simulated)")
	scaleInProcess = flag.Bool("scale.in-process", false, "run the controller inside the benchmark instead of as its own process (RSS and CPU are then the whole benchmark's)")
)

// BenchmarkScale runs the scale workload against the driver's controller
// running as its own process (the binary, as the chart runs it, reaching the
// simulated host over TLS with a token), so that its RSS and CPU are its
// own, and writes bench/results/scale-<flavor>.json with CPU and heap
// profiles beside it.
//
//	make bench BENCH=scale
func BenchmarkScale(b *testing.B) {
	name, err := flavorFlag(*harvesterFlag, "scale.flavor", *scaleFlavor, flagGiven("scale.flavor"))
	if err != nil {
		b.Fatal(err)
	}
	var f *flavor
	for i := range flavors {
		if flavors[i].name == name {
			f = &flavors[i]
		}
	}
	if f == nil {
		b.Fatalf("unknown -scale.flavor %q", name)
	}
	cfg := DefaultScale()
	cfg.VMs, cfg.Volumes, cfg.ChurnPerMinute, cfg.SameVM = *scaleVMs, *scaleVols, *scaleChurn, *scaleSameVM
	cfg.Warmup, cfg.Duration, cfg.Workers, cfg.Scale, cfg.Seed = *scaleWarmup, *scaleDuration, *scaleWorkers, *scaleTime, *scaleSeed
	cfg.PublishWait = *scalePubWait
	cfg.Dense, cfg.DenseDeadline = *scaleDense, *scaleDenseDL
	for range b.N {
		res := scaleOnce(b, *f, cfg)
		path, err := writeJSON(*resultDir, res.Name, res)
		if err != nil {
			b.Fatal(err)
		}
		b.Logf("%s: %d/%d unfinished, publish p50 %.1fs p99 %.1fs, unpublish p99 %.1fs, %.2f VM writes/op, %.2f host requests/op, %d conflicts, "+
			"RSS %.1f MiB (peak %.1f), CPU %.3f of a core (%.3f at the run's pace), goroutines %d -> %d, heap %.1f -> %.1f MiB -> %s",
			res.Name, res.Unfinished, res.Operations, res.PublishToReady.P50, res.PublishToReady.P99, res.Unpublish.P99,
			res.VMWritesPerOperation, res.HostRequestsPerOp, res.Conflicts, res.RSSMiB, res.RSSPeakMiB, res.CPUFraction, res.CPUFractionWall,
			res.GoroutinesStart, res.GoroutinesEnd, res.HeapStartMiB, res.HeapEndMiB, path)
		if d := res.Dense; d != nil {
			b.Logf("dense VM %s (%d volumes): initial attach %.0fs, %d/%d unfinished, publish p50 %.1fs p99 %.1fs, unpublish p50 %.1fs p99 %.1fs",
				d.VM, d.Volumes, d.InitialAttachSeconds, d.Unfinished, d.Operations, d.PublishToReady.P50, d.PublishToReady.P99, d.Unpublish.P50, d.Unpublish.P99)
			b.ReportMetric(d.PublishToReady.P50, "dense-publish-p50-s")
			b.ReportMetric(d.PublishToReady.P99, "dense-publish-p99-s")
		}
		b.ReportMetric(float64(res.Unfinished), "unfinished")
		b.ReportMetric(res.RSSMiB, "rss-MiB")
		b.ReportMetric(res.CPUFraction, "cpu-fraction")
		b.ReportMetric(res.HostRequestsPerOp, "host-requests/op")
	}
}

func scaleOnce(b *testing.B, f flavor, cfg ScaleConfig) ScaleResult {
	b.Helper()
	vmCount := cfg.VMs
	name := "scale-" + f.name
	if cfg.Dense > 0 {
		vmCount++ // the dense VM, the last one
		name += "-dense" + strconv.Itoa(cfg.Dense)
	}
	h, vms, vols := startFleet(b, f, cfg.Scale, cfg.Seed, "node-%02d", vmCount, "scale", cfg.Volumes)
	sh := &scaleHost{h: h}
	var sampler Sampler
	desc := ""
	if *scaleInProcess {
		d := scaledQueue(cfg.Scale)
		ctrl := h.StartController(b, framework.ControllerOptions{Queue: d, Driver: scaledDriver(cfg.Scale, cfg.PublishWait, 1)})
		sh.ctrl = ctrl.Client
		sampler = inProcessSampler{}
		desc = "this driver in the benchmark's process, backend " + ctrl.Queue.BackendName()
	} else {
		p := startControllerProcess(b, h, cfg, filepath.Join(*resultDir, name+"-controller.log"))
		sh.ctrl = p.client
		sampler = p
		desc = "this driver's binary as its own process (pid " + strconv.Itoa(p.proc.Pid()) + ")"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Hour)
	defer cancel()
	var profiles []string
	profile := func(kind, query, file string) {
		if p, ok := sampler.(*controllerProcess); ok {
			path := filepath.Join(*resultDir, name+"-"+file+".pprof")
			if err := p.saveProfile(ctx, kind, query, path); err != nil {
				b.Logf("profile %s: %v", kind, err)
				return
			}
			profiles = append(profiles, path)
		}
	}
	hooks := ScaleHooks{
		SteadyStart: func(context.Context) { profile("heap", "gc=1", "heap-start") },
		Midway: func(context.Context) {
			// A CPU profile of one simulated minute in the steady state.
			secs := max(1, int(time.Duration(float64(time.Minute)*cfg.Scale).Seconds()))
			profile("profile", "seconds="+strconv.Itoa(secs), "cpu")
		},
		SteadyEnd: func(context.Context) {
			profile("heap", "gc=1", "heap-end")
			profile("goroutine", "", "goroutines-end")
		},
	}
	res, err := RunScale(ctx, sh, sampler, cfg, vms, vols, hooks)
	if err != nil {
		b.Fatal(err)
	}
	res.Name, res.Controller, res.Profiles = name, desc, profiles
	if p, ok := sampler.(*controllerProcess); ok {
		res.RSSPeakMiB = p.peakRSS()
	}
	return res
}

// scaleHost adapts the host and a controller client to Host.
type scaleHost struct {
	h    *framework.Host
	ctrl csi.ControllerClient
}

func (s *scaleHost) Controller() csi.ControllerClient { return s.ctrl }
func (s *scaleHost) Reset()                           { simHost{h: s.h}.Reset() }
func (s *scaleHost) Counts() (int, int, map[string]int) {
	return simHost{h: s.h}.Counts()
}

// controllerProcess is the driver binary running the controller service.
type controllerProcess struct {
	proc    *proc.Proc
	metrics string // http://127.0.0.1:port
	client  csi.ControllerClient
}

// startControllerProcess builds (unless -scale.binary names one) and runs
// the driver binary against the simulated host, with the queue's timings
// and the client rate limit scaled like the simulator.
func startControllerProcess(b *testing.B, h *framework.Host, cfg ScaleConfig, logPath string) *controllerProcess {
	b.Helper()
	dir, err := os.MkdirTemp("", "hcsi-scale-") // unix socket paths must stay short
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	bin := *scaleBinary
	if bin == "" {
		bin = framework.BuildDriver(b, dir)
	}
	kcCtx, kcCancel := context.WithCancel(context.Background())
	b.Cleanup(kcCancel)
	kubeconfig := filepath.Join(dir, "host.kubeconfig")
	if err := h.Sim.WriteKubeconfig(kcCtx, kubeconfig, h.Namespace); err != nil {
		b.Fatal(err)
	}
	port, err := freePort()
	if err != nil {
		b.Fatal(err)
	}
	sock := filepath.Join(dir, "csi.sock")
	sc := func(d time.Duration) string { return time.Duration(float64(d) * cfg.Scale).String() }
	q := scaledQueue(cfg.Scale)
	args := []string{
		"--mode=controller", "--endpoint=unix://" + sock, "--kubeconfig=" + kubeconfig,
		"--metrics-address=127.0.0.1:" + strconv.Itoa(port), "--enable-pprof",
		"--node-monitor=false", "--detach-guard-timeout=0",
		"--batch-window=" + q.BatchWindow.String(), "--max-hold=" + q.MaxHold.String(),
		"--join-window=" + q.JoinWindow.String(),
		"--hotplug-qps=" + strconv.FormatFloat(q.QPS, 'f', -1, 64),
		// The client's rate limit is scaled too: at four times the pace the
		// same work makes four times the requests per second.
		"--kube-api-qps=" + strconv.FormatFloat(20/cfg.Scale, 'f', -1, 64), "--kube-api-burst=" + strconv.Itoa(int(40/cfg.Scale)),
		"--publish-margin=" + sc(2*time.Second), "--publish-wait=" + sc(cfg.PublishWait),
		"--publish-wait-crowd=1", // -scale.publish-wait is a plain bound, as in the in-process run
	}
	p := framework.StartProcess(b, filepath.Dir(logPath), proc.Spec{Name: strings.TrimSuffix(filepath.Base(logPath), ".log"), Path: bin, Args: args})
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	// Wait until Probe says ready (informers synced), as the sidecars do.
	up, cancelUp := context.WithTimeout(context.Background(), time.Minute)
	defer cancelUp()
	testwait.Until(up, b, "the controller process to come up (log: "+logPath+")", func() (bool, string) {
		if exited, err := p.Exited(); exited {
			b.Fatalf("controller process exited: %v (log: %s)", err, logPath)
		}
		ctx, cancel := context.WithTimeout(up, time.Second)
		resp, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		cancel()
		return err == nil && resp.GetReady().GetValue(), fmt.Sprintf("probe: %v", err)
	})
	return &controllerProcess{proc: p, metrics: "http://127.0.0.1:" + strconv.Itoa(port), client: csi.NewControllerClient(conn)}
}

// Sample forces a garbage collection (through the heap profile's gc=1), so
// the heap figures are what is live, then reads the process's metrics.
func (p *controllerProcess) Sample(ctx context.Context) (ProcessSample, error) {
	if err := p.get(ctx, "/debug/pprof/heap?gc=1", io.Discard); err != nil {
		return ProcessSample{}, err
	}
	var sb strings.Builder
	if err := p.get(ctx, "/metrics", &sb); err != nil {
		return ProcessSample{}, err
	}
	m := parseMetrics(sb.String())
	const mib = 1 << 20
	return ProcessSample{
		RSSMiB:       m["process_resident_memory_bytes"] / mib,
		CPUSeconds:   m["process_cpu_seconds_total"],
		Goroutines:   int(m["go_goroutines"]),
		HeapInuseMiB: m["go_memstats_heap_inuse_bytes"] / mib,
		HeapAllocMiB: m["go_memstats_heap_alloc_bytes"] / mib,
		HeapObjects:  int(m["go_memstats_heap_objects"]),
	}, nil
}

// peakRSS reads the process's resident high-water mark (VmHWM) in MiB.
func (p *controllerProcess) peakRSS() float64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", p.proc.Pid()))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

func (p *controllerProcess) saveProfile(ctx context.Context, kind, query, path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	u := "/debug/pprof/" + kind
	if query != "" {
		u += "?" + query
	}
	return p.get(ctx, u, f)
}

func (p *controllerProcess) get(ctx context.Context, path string, w io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.metrics+path, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	_, err = io.Copy(w, resp.Body)
	return err
}

// parseMetrics reads the unlabelled samples of a Prometheus text page.
func parseMetrics(text string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(text, "\n") {
		if line == "" || line[0] == '#' || strings.Contains(line, "{") {
			continue
		}
		name, val, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		if v, err := strconv.ParseFloat(strings.TrimSpace(val), 64); err == nil {
			out[name] = v
		}
	}
	return out
}

// inProcessSampler has no process of its own to read: the figures would be
// the whole benchmark's (API server client, simulator, attacher).
type inProcessSampler struct{}

func (inProcessSampler) Sample(context.Context) (ProcessSample, error) {
	return ProcessSample{}, fmt.Errorf("the controller runs in the benchmark's process: no figures of its own")
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
