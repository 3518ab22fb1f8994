package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
)

// ScaleConfig is the scale workload: Volumes volumes attached over VMs VMs,
// then ChurnPerMinute of them moved every simulated minute (unpublished from
// their VM and published to another, or to the same one with SameVM), at
// times spread evenly over the minute, for Duration. Durations are
// simulated time, multiplied by Scale like the simulator's latencies.
type ScaleConfig struct {
	VMs, Volumes   int
	ChurnPerMinute float64
	SameVM         float64
	// Warmup is how long the churn runs before the steady state is measured
	// (request counts reset, first samples taken); Duration is how long it
	// runs after that.
	Warmup, Duration time.Duration
	// SampleEvery is how often the controller's process figures are read.
	SampleEvery time.Duration
	// Workers, CallTimeout, RetryStart, RetryMax: the attacher, as in the
	// churn; Deadline bounds each publish and each unpublish.
	Workers                           int
	CallTimeout, RetryStart, RetryMax time.Duration
	Deadline                          time.Duration
	PublishWait                       time.Duration
	Seed                              uint64
	Scale                             float64
	// Dense, when above zero, is the dense shape: that many of the
	// Volumes sit on one more VM, churned on it (unpublished and published
	// back), the others spread over the VMs as before. Its operations are
	// bounded by DenseDeadline, and so is its initial attach: an attachment
	// pod holding that many volumes takes minutes to start.
	Dense         int
	DenseDeadline time.Duration
}

// DefaultScale is the scale workload: 50 VMs, 1,000 volumes, 10%
// moved per minute, with the chart's 100 attacher workers; 3 minutes of
// warm-up, then 30 minutes measured at half of real time, which keeps a run
// near 20 minutes and the simulated host (API server, etcd, simulator, all
// on the same machine) able to keep pace on two shared cores. An hour is
// -scale.duration=60m.
func DefaultScale() ScaleConfig {
	return ScaleConfig{VMs: 50, Volumes: 1000, ChurnPerMinute: 0.10, SameVM: 0.3,
		Warmup: 3 * time.Minute, Duration: 30 * time.Minute, SampleEvery: time.Minute,
		Workers: 100, CallTimeout: 15 * time.Second, RetryStart: time.Second, RetryMax: 5 * time.Minute,
		Deadline: 110 * time.Second, Seed: 1, Scale: 0.5, DenseDeadline: time.Hour}
}

// ProcessSample is the controller process as its metrics endpoint and
// /proc show it at one moment.
type ProcessSample struct {
	SimulatedSeconds float64 `json:"simulated_seconds"`
	RSSMiB           float64 `json:"rss_mib"`
	CPUSeconds       float64 `json:"cpu_seconds"`
	Goroutines       int     `json:"goroutines"`
	HeapInuseMiB     float64 `json:"heap_inuse_mib"`
	HeapAllocMiB     float64 `json:"heap_alloc_mib"`
	HeapObjects      int     `json:"heap_objects"`
	wall             time.Time
}

// Sampler reads the controller's process figures.
type Sampler interface {
	Sample(ctx context.Context) (ProcessSample, error)
}

// ScaleResult is what one scale run measured; it is written as JSON. The
// operation figures cover the steady state only (operations begun after the
// warm-up); an operation is one move: an unpublish and the publish after it.
// With the dense shape, Operations, Unfinished and the per-operation counts
// cover every VM, the latencies only the others, and Dense the dense VM's.
type ScaleResult struct {
	Name string `json:"name"`
	OperationFigures
	Dense *DenseFigures `json:"dense,omitempty"`
	// RSSMiB is the largest resident set seen in the steady state, and
	// RSSPeakMiB the process's high-water mark over its whole life
	// (including the initial attach of every volume).
	RSSMiB     float64 `json:"rss_mib"`
	RSSPeakMiB float64 `json:"rss_peak_mib,omitempty"`
	// CPUFraction is the controller's CPU time per simulated second in the
	// steady state (a fraction of one core at real speed); CPUFractionWall
	// the same per wall second, at the accelerated pace of the run.
	CPUFraction     float64 `json:"cpu_fraction"`
	CPUFractionWall float64 `json:"cpu_fraction_wall"`
	GoroutinesStart int     `json:"goroutines_start"`
	GoroutinesEnd   int     `json:"goroutines_end"`
	HeapStartMiB    float64 `json:"heap_inuse_start_mib"`
	HeapEndMiB      float64 `json:"heap_inuse_end_mib"`
	// InitialAttachSeconds is the simulated time the first attach of every
	// volume took (not part of the steady state).
	InitialAttachSeconds float64         `json:"initial_attach_seconds"`
	InitialUnfinished    int             `json:"initial_unfinished"`
	Samples              []ProcessSample `json:"samples"`
	Config               ScaleConfig     `json:"config"`
	SimulatedSeconds     float64         `json:"simulated_seconds"`
	WallSeconds          float64         `json:"wall_seconds"`
	Controller           string          `json:"controller"`
	Profiles             []string        `json:"profiles,omitempty"`
}

// DenseFigures are the dense VM's own operations in the steady state.
type DenseFigures struct {
	VM                   string      `json:"vm"`
	Volumes              int         `json:"volumes"`
	Operations           int         `json:"operations"`
	Unfinished           int         `json:"unfinished"`
	PublishToReady       Percentiles `json:"publish_to_ready_seconds"`
	Unpublish            Percentiles `json:"unpublish_seconds"`
	InitialAttachSeconds float64     `json:"initial_attach_seconds"`
}

// scaleOp is one move of one volume.
type scaleOp struct {
	vol, from, to        string
	dense                bool // on the dense VM
	counted              bool // begun after the warm-up
	unpubAsked, unpubEnd time.Time
	pubAsked, pubEnd     time.Time
	unpubOK, pubOK       bool
}

// ScaleHooks lets the harness act at the steady state's edges (profiles).
type ScaleHooks struct {
	// SteadyStart runs once the warm-up is over and the first sample taken;
	// Midway halfway through the steady state (in its own goroutine);
	// SteadyEnd after the last sample.
	SteadyStart, Midway, SteadyEnd func(ctx context.Context)
}

// RunScale attaches every volume, then moves ChurnPerMinute of them every
// minute, and measures.
func RunScale(ctx context.Context, h Host, s Sampler, cfg ScaleConfig, vms, vols []string, hooks ScaleHooks) (ScaleResult, error) {
	sim := func(d time.Duration) time.Duration { return time.Duration(float64(d) * cfg.Scale) }
	simSeconds := func(d time.Duration) float64 { return d.Seconds() / cfg.Scale }
	rng := rand.New(rand.NewPCG(cfg.Seed, 11))
	att := newAttacher(h, ChurnConfig{Workers: cfg.Workers, CallTimeout: cfg.CallTimeout, RetryStart: cfg.RetryStart,
		RetryMax: cfg.RetryMax, Scale: cfg.Scale})
	res := ScaleResult{Config: cfg}
	denseVM, vms, err := splitDense(cfg, vms, vols)
	if err != nil {
		return res, err
	}
	isDense := func(i int) bool { return i < cfg.Dense }
	denseVol := make(map[string]bool, cfg.Dense)
	for _, v := range vols[:cfg.Dense] {
		denseVol[v] = true
	}
	deadline := func(dense bool) time.Duration {
		if dense {
			return cfg.DenseDeadline
		}
		return cfg.Deadline
	}

	// Every volume starts on VM i mod VMs (the dense ones on the dense VM),
	// all asked for at once.
	where := make(map[string]string, len(vols))
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	var denseDone time.Time
	for i, v := range vols {
		vm, bound := vms[i%len(vms)], sim(10*time.Minute)
		if isDense(i) {
			vm, bound = denseVM, sim(max(10*time.Minute, cfg.DenseDeadline))
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, cancel := context.WithDeadline(ctx, start.Add(bound))
			defer cancel()
			err := att.Publish(c, publishReq(vm, v))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				res.InitialUnfinished++
				return
			}
			where[v] = vm
			if isDense(i) {
				denseDone = time.Now()
			}
		}()
	}
	wg.Wait()
	res.InitialAttachSeconds = simSeconds(time.Since(start))
	if cfg.Dense > 0 {
		res.Dense = &DenseFigures{VM: denseVM, Volumes: cfg.Dense, InitialAttachSeconds: simSeconds(denseDone.Sub(start))}
	}
	if res.InitialUnfinished > 0 {
		return res, fmt.Errorf("%d of %d volumes not attached in time (10 simulated minutes, the dense VM's %v)", res.InitialUnfinished, len(vols), cfg.DenseDeadline)
	}

	// The churn: every minute, ChurnPerMinute of the volumes not moving at
	// the moment are picked and each moved at an even-spread random time.
	churnStart := time.Now()
	steadyAt := churnStart.Add(sim(cfg.Warmup))
	endAt := steadyAt.Add(sim(cfg.Duration))
	idle := make([]string, 0, len(vols))
	idle = append(idle, vols...)
	var ops []*scaleOp
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	perMinute := int(cfg.ChurnPerMinute*float64(len(vols)) + 0.5)
	var opsWG sync.WaitGroup
	move := func(o *scaleOp, at time.Time) {
		defer opsWG.Done()
		if !sleepUntil(runCtx, at) {
			mu.Lock()
			idle = append(idle, o.vol)
			mu.Unlock()
			return
		}
		o.counted = !time.Now().Before(steadyAt)
		o.unpubAsked = time.Now()
		c, cc := context.WithDeadline(ctx, o.unpubAsked.Add(sim(deadline(o.dense))))
		err := att.Unpublish(c, o.from, o.vol)
		cc()
		o.unpubEnd, o.unpubOK = time.Now(), err == nil
		if !o.unpubOK {
			return // the volume's state is unknown: it is not moved again
		}
		o.pubAsked = time.Now()
		c, cc = context.WithDeadline(ctx, o.pubAsked.Add(sim(deadline(o.dense))))
		err = att.Publish(c, publishReq(o.to, o.vol))
		cc()
		o.pubEnd, o.pubOK = time.Now(), err == nil
		if o.pubOK {
			mu.Lock()
			where[o.vol] = o.to
			idle = append(idle, o.vol)
			mu.Unlock()
		}
	}

	var samples []ProcessSample
	sample := func() {
		ps, err := s.Sample(ctx)
		if err != nil {
			return
		}
		ps.wall = time.Now()
		ps.SimulatedSeconds = simSeconds(ps.wall.Sub(churnStart))
		samples = append(samples, ps)
	}
	nextSample := steadyAt
	steady := false
	midwayDone := false
	for minute := 0; ; minute++ {
		minuteAt := churnStart.Add(sim(time.Duration(minute) * time.Minute))
		if !minuteAt.Before(endAt) {
			break
		}
		mu.Lock()
		rng.Shuffle(len(idle), func(i, j int) { idle[i], idle[j] = idle[j], idle[i] })
		n := min(perMinute, len(idle))
		picked := append([]string(nil), idle[:n]...)
		idle = idle[n:]
		for _, v := range picked {
			from := where[v]
			to := from
			// A dense volume goes back to the dense VM, which keeps its
			// count; the others never go there.
			if rng.Float64() >= cfg.SameVM && !denseVol[v] {
				for to == from {
					to = vms[rng.IntN(len(vms))]
				}
			}
			o := &scaleOp{vol: v, from: from, to: to, dense: denseVol[v]}
			ops = append(ops, o)
			opsWG.Add(1)
			go move(o, minuteAt.Add(time.Duration(rng.Int64N(int64(sim(time.Minute))))))
		}
		mu.Unlock()
		// Sample (and begin the steady state) while this minute runs.
		nextMinute := churnStart.Add(sim(time.Duration(minute+1) * time.Minute))
		for nextSample.Before(nextMinute) && nextSample.Before(endAt) {
			if !sleepUntil(ctx, nextSample) {
				return res, ctx.Err()
			}
			if !steady {
				steady = true
				h.Reset()
				sample()
				if hooks.SteadyStart != nil {
					hooks.SteadyStart(ctx)
				}
			} else {
				sample()
			}
			if !midwayDone && !nextSample.Before(steadyAt.Add(sim(cfg.Duration/2))) && hooks.Midway != nil {
				midwayDone = true
				go hooks.Midway(ctx)
			}
			nextSample = nextSample.Add(sim(cfg.SampleEvery))
		}
		if !sleepUntil(ctx, nextMinute) {
			return res, ctx.Err()
		}
	}
	sleepUntil(ctx, endAt)
	sample()
	writes, conflicts, reqs := h.Counts()
	if hooks.SteadyEnd != nil {
		hooks.SteadyEnd(ctx)
	}
	cancel() // moves not begun yet are dropped; those under way finish
	opsWG.Wait()
	res.WallSeconds = time.Since(start).Seconds()
	res.SimulatedSeconds = res.WallSeconds / cfg.Scale
	res.Answers = answers(att)

	var pubs, unpubs, densePubs, denseUnpubs []float64
	for _, o := range ops {
		if !o.counted || o.unpubAsked.IsZero() || o.unpubAsked.After(endAt) {
			continue
		}
		res.Operations++
		p, u := &pubs, &unpubs
		if o.dense {
			res.Dense.Operations++
			p, u = &densePubs, &denseUnpubs
		}
		if !o.unpubOK || !o.pubOK {
			res.Unfinished++
			if o.dense {
				res.Dense.Unfinished++
			}
		}
		if o.unpubOK {
			*u = append(*u, simSeconds(o.unpubEnd.Sub(o.unpubAsked)))
		}
		if o.pubOK {
			*p = append(*p, simSeconds(o.pubEnd.Sub(o.pubAsked)))
		}
	}
	res.PublishToReady, res.Unpublish = percentiles(pubs), percentiles(unpubs)
	if res.Dense != nil {
		res.Dense.PublishToReady, res.Dense.Unpublish = percentiles(densePubs), percentiles(denseUnpubs)
	}
	res.count(writes, conflicts, reqs)

	res.Samples = samples
	if len(samples) >= 2 {
		first, last := samples[0], samples[len(samples)-1]
		for _, ps := range samples {
			res.RSSMiB = max(res.RSSMiB, ps.RSSMiB)
		}
		wall := last.wall.Sub(first.wall).Seconds()
		res.CPUFractionWall = (last.CPUSeconds - first.CPUSeconds) / wall
		res.CPUFraction = res.CPUFractionWall * cfg.Scale
		res.GoroutinesStart, res.GoroutinesEnd = first.Goroutines, last.Goroutines
		res.HeapStartMiB, res.HeapEndMiB = first.HeapInuseMiB, last.HeapInuseMiB
	}
	return res, nil
}

// splitDense returns the dense VM (the last of vms when cfg.Dense is above
// zero, "" otherwise) and the others; the first cfg.Dense volumes are the
// dense VM's.
func splitDense(cfg ScaleConfig, vms, vols []string) (string, []string, error) {
	switch {
	case cfg.Dense < 0 || cfg.Dense > len(vols):
		return "", nil, fmt.Errorf("dense shape of %d volumes out of the %d", cfg.Dense, len(vols))
	case cfg.Dense == 0:
		return "", vms, nil
	case len(vms) < 2:
		return "", nil, fmt.Errorf("the dense shape needs a VM besides the others, got %d VMs", len(vms))
	}
	return vms[len(vms)-1], vms[:len(vms)-1], nil
}
