// Package bench holds the churn benchmark of docs/benchmarks.md: waves of
// publishes and unpublishes driven the way the external-attacher drives a CSI
// controller, against the KubeVirt simulator, with figures written as JSON.
package bench

import (
	"context"
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/internal/csiattacher"
	"github.com/harvester-csi/harvester-csi-driver/internal/percentile"
)

// ChurnConfig is the wave workload. Durations are simulated time: the
// harness divides them by nothing and multiplies them by Scale, exactly as
// the simulator scales KubeVirt's latencies.
type ChurnConfig struct {
	VMs, Volumes, Waves int
	// Period is the time between waves; every volume is published at the
	// start of a wave (once its previous unpublish finished), held for a
	// time between HoldMin and HoldMax, then unpublished.
	Period, HoldMin, HoldMax time.Duration
	// SameVM is the share of volumes that land on the VM they were on.
	SameVM float64
	// Workers is the attacher's --worker-threads, CallTimeout its
	// --timeout; RetryStart and RetryMax its retry backoff.
	Workers                           int
	CallTimeout, RetryStart, RetryMax time.Duration
	// Deadline: an operation not finished this long after it began counts
	// as unfinished.
	Deadline time.Duration
	// PublishWait and PublishWaitCrowd are the driver's --publish-wait
	// (0: up to the deadline) and --publish-wait-crowd.
	PublishWait      time.Duration
	PublishWaitCrowd int
	Seed             uint64
	Scale            float64
}

// DefaultChurn is the workload: 5 VMs, 40 volumes, a wave every 80 s,
// holds of 5-15 s, 30% back to the same VM, 8 waves (320 operations), the
// external-attacher's defaults (10 workers, 15 s calls, 1 s .. 5 min
// backoff) and a 110 s bound.
func DefaultChurn() ChurnConfig {
	return ChurnConfig{VMs: 5, Volumes: 40, Waves: 8, Period: 80 * time.Second, HoldMin: 5 * time.Second, HoldMax: 15 * time.Second,
		SameVM: 0.3, Workers: 10, CallTimeout: 15 * time.Second, RetryStart: time.Second, RetryMax: 5 * time.Minute,
		Deadline: 110 * time.Second, Seed: 1, Scale: 0.1}
}

// Percentiles summarize durations in simulated seconds.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P95 float64 `json:"p95"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

// OperationFigures are the per-operation figures both the churn and the
// scale benchmark report; an operation is a publish and its unpublish.
type OperationFigures struct {
	Operations           int            `json:"operations"`
	Unfinished           int            `json:"unfinished"`
	PublishToReady       Percentiles    `json:"publish_to_ready_seconds"`
	Unpublish            Percentiles    `json:"unpublish_seconds"`
	VMWritesPerOperation float64        `json:"vm_writes_per_operation"`
	Conflicts            int            `json:"conflicts"`
	HostRequestsPerOp    float64        `json:"host_requests_per_operation"`
	HostRequestsByKind   map[string]int `json:"host_requests_by_kind,omitempty"`
	Answers              map[string]int `json:"answers"` // gRPC code -> count, all calls
}

// count sets the figures that come from the host's counts (Host.Counts);
// Operations must be set.
func (f *OperationFigures) count(writes, conflicts int, reqs map[string]int) {
	total := 0
	for k, n := range reqs {
		if !strings.HasPrefix(k, "conflict ") { // answers, not requests
			total += n
		}
	}
	if f.Operations > 0 {
		f.VMWritesPerOperation = float64(writes) / float64(f.Operations)
		f.HostRequestsPerOp = float64(total) / float64(f.Operations)
	}
	f.Conflicts, f.HostRequestsByKind = conflicts, reqs
}

// ChurnResult is what one run measured; it is written as JSON. Operations
// is the number of publish-hold-unpublish cycles asked for; Unfinished
// those whose publish or unpublish did not finish within the deadline.
type ChurnResult struct {
	Name string `json:"name"`
	OperationFigures
	Config                ChurnConfig `json:"config"`
	SimulatedSeconds      float64     `json:"simulated_seconds"`
	WallSeconds           float64     `json:"wall_seconds"`
	ControllerDescription string      `json:"controller"`
	// DriverBatches counts the queue's writes (one batch of changes to one
	// VM each); AttachmentPods the attachment pods KubeVirt created
	// meanwhile. About one pod per batch means KubeVirt carried out each
	// batch in one pass (for the legacy calls: folded the batch's
	// back-to-back addvolume/removevolume requests into one spec update).
	DriverBatches  int `json:"driver_batches,omitempty"`
	AttachmentPods int `json:"attachment_pods,omitempty"`
	// VMSpecUpdates counts the changes of the VMs' specs (their
	// generation), by the driver or by KubeVirt's VM controller: in legacy
	// mode about one per batch means KubeVirt folded the batch's requests
	// into one spec update.
	VMSpecUpdates int `json:"vm_spec_updates,omitempty"`
}

// Host is what the churn needs from a simulated host and its controller.
type Host interface {
	// Controller is the CSI controller to drive (it may change when the
	// controller restarts).
	Controller() csi.ControllerClient
	// Counts returns the VM writes, the 409/422 answers and the non-watch
	// requests (by kind) that reached the host since the last Reset.
	Counts() (vmWrites, conflicts int, requests map[string]int)
	Reset()
}

// op is one volume's cycle in one wave.
type op struct {
	vol, vm                string
	hold                   time.Duration
	start                  time.Time // publish asked for
	published, unpublished time.Time
	publishOK, unpublishOK bool
	publishErr, unpubErr   error
	unpublishAsked         time.Time
}

// RunChurn drives cfg's waves against h, with vms and vols created.
func RunChurn(ctx context.Context, h Host, cfg ChurnConfig, vms, vols []string) ChurnResult {
	sim := func(d time.Duration) time.Duration { return time.Duration(float64(d) * cfg.Scale) }
	rng := rand.New(rand.NewPCG(cfg.Seed, 7))
	// The plan is drawn up front so it depends on the seed alone.
	plan := make([][]*op, cfg.Volumes)
	for v := range plan {
		prev := ""
		for range cfg.Waves {
			vm := vms[rng.IntN(len(vms))]
			if prev != "" && rng.Float64() < cfg.SameVM {
				vm = prev
			} else if prev != "" && len(vms) > 1 {
				for vm == prev {
					vm = vms[rng.IntN(len(vms))]
				}
			}
			hold := cfg.HoldMin + time.Duration(rng.Int64N(int64(cfg.HoldMax-cfg.HoldMin)+1))
			plan[v] = append(plan[v], &op{vol: vols[v], vm: vm, hold: hold})
			prev = vm
		}
	}

	h.Reset()
	att := newAttacher(h, cfg)
	start := time.Now()
	runCtx, cancel := context.WithTimeout(ctx, sim(time.Duration(cfg.Waves)*cfg.Period+cfg.Deadline+cfg.HoldMax))
	defer cancel()
	var wg sync.WaitGroup
	for v := range plan {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for w, o := range plan[v] {
				at := start.Add(sim(time.Duration(w) * cfg.Period))
				if !sleepUntil(runCtx, at) {
					return
				}
				o.start = time.Now()
				opCtx, opCancel := context.WithDeadline(runCtx, o.start.Add(sim(cfg.Deadline)))
				o.publishErr = att.Publish(opCtx, publishReq(o.vm, o.vol))
				o.published, o.publishOK = time.Now(), o.publishErr == nil
				opCancel()
				if !sleepUntil(runCtx, time.Now().Add(sim(o.hold))) {
					return
				}
				o.unpublishAsked = time.Now()
				opCtx, opCancel = context.WithDeadline(runCtx, o.unpublishAsked.Add(sim(cfg.Deadline)))
				o.unpubErr = att.Unpublish(opCtx, o.vm, o.vol)
				o.unpublished, o.unpublishOK = time.Now(), o.unpubErr == nil
				opCancel()
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)

	res := ChurnResult{Config: cfg, WallSeconds: wall.Seconds(), SimulatedSeconds: wall.Seconds() / cfg.Scale,
		OperationFigures: OperationFigures{Operations: cfg.Volumes * cfg.Waves, Answers: answers(att)}}
	var pubs, unpubs []float64
	for v := range plan {
		for _, o := range plan[v] {
			if !o.publishOK || !o.unpublishOK {
				res.Unfinished++
			}
			if o.publishOK {
				pubs = append(pubs, o.published.Sub(o.start).Seconds()/cfg.Scale)
			}
			if o.unpublishOK {
				unpubs = append(unpubs, o.unpublished.Sub(o.unpublishAsked).Seconds()/cfg.Scale)
			}
		}
	}
	res.PublishToReady, res.Unpublish = percentiles(pubs), percentiles(unpubs)
	res.count(h.Counts())
	return res
}

// Write stores res as dir/<res.Name>.json.
func (res ChurnResult) Write(dir string) (string, error) { return writeJSON(dir, res.Name, res) }

// writeJSON stores v as dir/<name>.json.
func writeJSON(dir, name string, v any) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, name+".json")
	return path, os.WriteFile(path, append(b, '\n'), 0o644)
}

func percentiles(xs []float64) Percentiles {
	if len(xs) == 0 {
		return Percentiles{}
	}
	slices.Sort(xs)
	at := func(p float64) float64 { return math.Round(percentile.Nearest(xs, p)*10) / 10 }
	return Percentiles{P50: at(0.5), P95: at(0.95), P99: at(0.99), Max: at(1)}
}

func sleepUntil(ctx context.Context, t time.Time) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(time.Until(t)):
		return true
	}
}

func publishReq(vm, vol string) *csi.ControllerPublishVolumeRequest {
	return &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}
}

// newAttacher is the external-attacher with cfg's flags, its durations
// scaled as the simulator's: it retries every answer but OK
// (internal/csiattacher).
func newAttacher(h Host, cfg ChurnConfig) *csiattacher.Attacher {
	return csiattacher.New(csiattacher.Config{Workers: cfg.Workers, Timeout: cfg.CallTimeout, RetryStart: cfg.RetryStart,
		RetryMax: cfg.RetryMax}.Scaled(cfg.Scale), h.Controller)
}

// answers counts att's answers by the code's name, as the results store them.
func answers(att *csiattacher.Attacher) map[string]int {
	out := map[string]int{}
	for c, n := range att.Answers() {
		out[c.String()] = n
	}
	return out
}
