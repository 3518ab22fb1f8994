package hotplug

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testmetrics"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// wedgeLog records the notices a queue gives.
type wedgeLog struct {
	mu  sync.Mutex
	got []WedgeNotice
}

func (l *wedgeLog) ReportWedge(_ context.Context, n WedgeNotice) {
	l.mu.Lock()
	l.got = append(l.got, n)
	l.mu.Unlock()
}

func (l *wedgeLog) take() []WedgeNotice {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.got
	l.got = nil
	return out
}

// passes runs the worker's bookkeeping of one VM on a clock the test sets,
// without informers or a backend: decide on what the test says KubeVirt
// shows, then applyPlanLocked, as sync does.
type passes struct {
	t   *testing.T
	q   *Queue
	key cache.ObjectName
	w   *vmWork
	log *wedgeLog
}

func newPasses(t *testing.T, cfg Config) *passes {
	cfg.Namespace = ns
	q := &Queue{cfg: cfg.withDefaults(), work: map[cache.ObjectName]*vmWork{},
		wq: workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[cache.ObjectName]())}
	t.Cleanup(q.wq.ShutDown)
	q.metrics = newMetrics(q)
	q.metrics.bind("fake")
	log := &wedgeLog{}
	q.SetWedgeReporter(log)
	key := q.key("vm1")
	return &passes{t: t, q: q, key: key, w: q.vmWork(key), log: log}
}

// at makes one pass at now over o and returns the notices it gave.
func (p *passes) at(now time.Time, o observed) []WedgeNotice {
	ctx := context.Background()
	p.q.mu.Lock()
	p.q.now = func() time.Time { return now }
	notices := p.q.applyPlanLocked(ctx, p.key, p.w, decide(now, p.q.cfg, p.w, facts{o: o}), now)
	p.q.mu.Unlock()
	p.q.reportWedges(ctx, notices)
	return p.log.take()
}

func (p *passes) wedged() map[string]int {
	p.q.mu.Lock()
	defer p.q.mu.Unlock()
	return p.q.wedgedLocked()
}

// withPod gives the VMI's entry of vol an attachment pod, as KubeVirt does
// once it created one for the volume.
func withPod(vmi *kubevirtv1.VirtualMachineInstance, vol, pod string) *kubevirtv1.VirtualMachineInstance {
	for i := range vmi.Status.VolumeStatus {
		if vmi.Status.VolumeStatus[i].Name == vol {
			vmi.Status.VolumeStatus[i].HotplugVolume.AttachPodName = pod
		}
	}
	return vmi
}

// An attach whose VMI entry never advances is wedged once WedgedAfter has
// passed without progress, reported once however many passes follow, and
// no longer when KubeVirt moves (a new attachment pod); a message KubeVirt
// rewrites on each retry is no progress. The bound runs again from the
// move, and the wedge ends when the intent is done.
func TestWedgeFollowsKubeVirtsProgress(t *testing.T) {
	bound := time.Minute
	p := newPasses(t, Config{WedgedAfter: bound, SlowAfter: time.Hour, MaxHold: 30 * time.Second})
	t0 := time.Unix(10_000, 0)
	p.w.intents["a"] = newIntent("vm1", "a", Attach, t0)
	stuck := func(pod, message string) observed {
		vmi := withPod(vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeBound}), "a", pod)
		vmi.Status.VolumeStatus[0].Message = message
		return observed{vm: vmWith([]string{"a"}), vmi: vmi}
	}

	if got := p.at(t0, stuck("hp-volume-1", "")); len(got) != 0 {
		t.Fatalf("notices at the start of the wait: %+v", got)
	}
	if got := p.at(t0.Add(bound-time.Second), stuck("hp-volume-1", "")); len(got) != 0 || len(p.wedged()) != 0 {
		t.Fatalf("wedged before the bound: %+v %v", got, p.wedged())
	}
	got := p.at(t0.Add(bound), stuck("hp-volume-1", ""))
	if len(got) != 1 || got[0].Cleared || got[0].Volume != "a" || got[0].VM != "vm1" || got[0].Op != Attach {
		t.Fatalf("notices at the bound: %+v, want one wedge of the attach of a", got)
	}
	if w := got[0].Wedge; w.Reason != WedgePlug || w.AttachmentPod != "hp-volume-1" || !w.Since.Equal(t0) || !strings.Contains(w.State, "Bound") {
		t.Errorf("wedge %+v, want reason %s, pod hp-volume-1, since %v, the phase named", w, WedgePlug, t0)
	}
	if n := p.wedged()[WedgePlug]; n != 1 {
		t.Errorf("wedged count %v, want 1 %s", p.wedged(), WedgePlug)
	}
	if st := p.q.State(); len(st) != 1 || len(st[0].Intents) != 1 || st[0].Intents[0].Wedged == nil {
		t.Errorf("state %+v does not show the wedge", st)
	}
	for i := 2; i < 5; i++ {
		if got := p.at(t0.Add(time.Duration(i)*bound), stuck("hp-volume-1", fmt.Sprintf("retry %d", i))); len(got) != 0 {
			t.Fatalf("pass %d gave %+v: a wedge is reported once, and a rewritten message is no progress", i, got)
		}
	}

	moved := t0.Add(5 * bound)
	got = p.at(moved, stuck("hp-volume-2", ""))
	if len(got) != 1 || !got[0].Cleared || got[0].Wedge.AttachmentPod != "hp-volume-1" {
		t.Fatalf("notices when KubeVirt made a new attachment pod: %+v, want the wedge cleared", got)
	}
	if len(p.wedged()) != 0 && p.wedged()[WedgePlug] != 0 {
		t.Fatalf("still counted wedged after progress: %v", p.wedged())
	}
	if got := p.at(moved.Add(bound-time.Second), stuck("hp-volume-2", "")); len(got) != 0 {
		t.Fatalf("wedged again before the bound ran from the move: %+v", got)
	}
	if got := p.at(moved.Add(bound), stuck("hp-volume-2", "")); len(got) != 1 || got[0].Cleared || !got[0].Wedge.Since.Equal(moved) {
		t.Fatalf("notices a bound after the move: %+v, want a new wedge since %v", got, moved)
	}

	done := observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady})}
	if got := p.at(moved.Add(2*bound), done); len(got) != 1 || !got[0].Cleared {
		t.Fatalf("notices when the attach is done: %+v, want the wedge cleared", got)
	}
	if p.wedged()[WedgePlug] != 0 {
		t.Fatalf("still counted wedged once done: %v", p.wedged())
	}
}

// A detach whose removed entry stays in the VMI (KubeVirt's unplug never
// finishing) is wedged on the unplug, and an add of another volume waiting
// behind it names it.
func TestWedgedRemovalIsNamedByTheAddBehindIt(t *testing.T) {
	bound := time.Minute
	p := newPasses(t, Config{WedgedAfter: bound, SlowAfter: time.Hour, MaxHold: 30 * time.Second})
	t0 := time.Unix(10_000, 0)
	p.w.intents["old"] = newIntent("vm1", "old", Detach, t0)
	p.w.intents["new"] = newIntent("vm1", "new", Attach, t0)
	vmi := withPod(vmiWith(map[string]kubevirtv1.VolumePhase{"old": kubevirtv1.HotplugVolumeDetaching, "new": kubevirtv1.VolumeBound}), "old", "hp-volume-old")
	vmi.Spec.Volumes = vmi.Spec.Volumes[:1] // "new" sorts first: "old" is gone from the VMI spec
	o := observed{vm: vmWith([]string{"new"}), vmi: vmi}
	p.at(t0, o)
	got := p.at(t0.Add(bound), o)
	reasons := map[string]Wedge{}
	for _, n := range got {
		reasons[n.Volume] = n.Wedge
	}
	if len(got) != 2 || reasons["old"].Reason != WedgeUnplug || reasons["new"].Reason != WedgePlug {
		t.Fatalf("notices %+v, want the removal wedged on %s and the add on %s", got, WedgeUnplug, WedgePlug)
	}
	if others := strings.Join(reasons["new"].Others, ","); !strings.Contains(others, "old (Detaching, attachment pod hp-volume-old)") {
		t.Errorf("the add's wedge names %q, want the removal in its way with its attachment pod", others)
	}
}

// Waits that are the queue's own (gathering a batch, pacing behind a change
// KubeVirt is carrying out, its cache or its own write not showing yet) or
// on a VM whose VMI does not run are never wedges, however long they last.
func TestOnlyWaitsOnARunningKubeVirtWedge(t *testing.T) {
	bound := time.Minute
	t0 := time.Unix(10_000, 0)
	settling := vmiWith(map[string]kubevirtv1.VolumePhase{"b": kubevirtv1.HotplugVolumeAttachedToNode})
	for _, tc := range []struct {
		name  string
		setup func(w *vmWork)
		o     observed
	}{
		{name: "gathering a batch", setup: func(w *vmWork) { w.gatherUntil = t0.Add(time.Hour) },
			o: observed{vm: vmWith(nil), vmi: vmiWith(nil)}},
		{name: "paced behind a change KubeVirt is carrying out", setup: func(w *vmWork) {
			w.settlingSince = t0
			w.progress = (observed{vm: vmWith([]string{"b"}), vmi: settling}).progressMark()
		},
			o: observed{vm: vmWith([]string{"b"}), vmi: settling}},
		{name: "the VM not in the cache yet", o: observed{}},
		{name: "its own write not showing yet", setup: func(w *vmWork) { w.expect["a"] = expectation{op: Attach, since: t0} },
			o: observed{vm: vmWith(nil), vmi: vmiWith(nil)}},
		{name: "a stopped VM", o: observed{vm: vmWith([]string{"a"})}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPasses(t, Config{WedgedAfter: bound, SlowAfter: time.Hour, MaxHold: time.Hour})
			p.w.intents["a"] = newIntent("vm1", "a", Attach, t0)
			if tc.setup != nil {
				tc.setup(p.w)
			}
			for i := range 10 {
				if got := p.at(t0.Add(time.Duration(i)*bound), tc.o); len(got) != 0 {
					t.Fatalf("pass %d: %+v", i, got)
				}
			}
			if p.wedged()[WedgePlug]+p.wedged()[WedgeQueuedRequest]+p.wedged()[WedgePreviousAttachment] != 0 {
				t.Fatalf("counted wedged: %v", p.wedged())
			}
			if st := p.q.State(); len(st) != 1 || st[0].Intents[0].WaitingFor == "" || st[0].Intents[0].Wedged != nil {
				t.Fatalf("state %+v, want a wait that is not a wedge", st)
			}
		})
	}
}

// A caller whose deadline comes while its attach is wedged hears so, with
// the code-bearing context error still inside; the gauge counts the wedge,
// the reporter hears of it once across the retries, and both clear when
// KubeVirt finishes.
func TestWedgedAttachIsAnsweredCountedAndCleared(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.readyDelay = time.Hour // the VMI does not follow until the test says so
	cfg := fastConfig()
	cfg.WedgedAfter = 300 * time.Millisecond
	q, reg := startQueue(t, f, cfg)
	log := &wedgeLog{}
	q.SetWedgeReporter(log)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go func() {
		short, c := context.WithTimeout(ctx, 100*time.Millisecond)
		defer c()
		_ = q.Attach(short, "vm1", "pvc-a", true)
	}()
	testwait.Until(ctx, t, "the attach to be wedged", func() (bool, string) {
		return wedgedGauge(t, reg, WedgePlug) == 1, fmt.Sprintf("%+v", q.State())
	})
	for range 3 {
		short, c := context.WithTimeout(ctx, 100*time.Millisecond)
		err := q.Attach(short, "vm1", "pvc-a", true)
		c()
		var wedged *WedgedError
		if !errors.As(err, &wedged) || !errors.Is(err, context.DeadlineExceeded) || wedged.Wedge.Reason != WedgePlug ||
			!strings.Contains(err.Error(), "pvc-a") || !strings.Contains(err.Error(), "wedged in KubeVirt") {
			t.Fatalf("attach answered %v, want a WedgedError on %s that keeps DeadlineExceeded", err, WedgePlug)
		}
	}
	f.followSpec("vm1")
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the wedge to clear", func() (bool, string) {
		g := wedgedGauge(t, reg, WedgePlug)
		return g == 0, fmt.Sprint(g)
	})
	testwait.Until(ctx, t, "the reporter to hear the end", func() (bool, string) {
		log.mu.Lock()
		defer log.mu.Unlock()
		return len(log.got) == 2, fmt.Sprintf("%+v", log.got)
	})
	got := log.take()
	if got[0].Cleared || !got[1].Cleared || got[0].Volume != "pvc-a" {
		t.Fatalf("notices %+v, want one wedge then its end", got)
	}
}

func wedgedGauge(t *testing.T, reg prometheus.Gatherer, reason string) float64 {
	t.Helper()
	if v, ok := testmetrics.Value(t, reg, "harvester_csi_hotplug_wedged_intents", map[string]string{"reason": reason}); ok {
		return v
	}
	return -1
}

// A wedged intent answered outside the worker's pass (a caller that finds
// the volume attached first) still gets its end reported: the VM's work is
// kept, and looked at, until the worker has said so.
func TestWedgeEndsWhenItsIntentIsAnsweredElsewhere(t *testing.T) {
	bound := time.Minute
	p := newPasses(t, Config{WedgedAfter: bound, SlowAfter: time.Hour, MaxHold: 30 * time.Second})
	t0 := time.Unix(10_000, 0)
	p.w.intents["a"] = newIntent("vm1", "a", Attach, t0)
	stuck := observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeBound})}
	p.at(t0, stuck)
	if got := p.at(t0.Add(bound), stuck); len(got) != 1 || got[0].Cleared {
		t.Fatalf("notices %+v, want the wedge", got)
	}
	p.q.mu.Lock()
	p.q.finishLocked(p.w, p.w.intents["a"], nil)
	p.q.dropIfIdleLocked(p.key)
	_, kept := p.q.work[p.key]
	p.q.mu.Unlock()
	if !kept {
		t.Fatal("the VM's work was dropped with a wedge nobody reported the end of")
	}
	if n := p.q.wq.Len(); n != 1 {
		t.Fatalf("%d VMs queued, want the VM looked at again", n)
	}
	done := observed{vm: vmWith([]string{"a"}), vmi: vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.VolumeReady})}
	if got := p.at(t0.Add(bound+time.Second), done); len(got) != 1 || !got[0].Cleared {
		t.Fatalf("notices %+v, want the wedge's end", got)
	}
	p.q.mu.Lock()
	p.q.dropIfIdleLocked(p.key)
	_, kept = p.q.work[p.key]
	p.q.mu.Unlock()
	if kept {
		t.Error("the VM's work outlived the wedge's end")
	}
}

// A change waiting on a VMI that live-migrates is no wedge, however long
// the migration takes (KubeVirt's own bound is 150 s per GiB, kubevirt
// v1.7.0 pkg/virt-config/virt-config.go:44 MigrationCompletionTimeoutPerGiB):
// virt-handler carries out no hotplug until the VMI runs on the target
// node. The wait says so. Once the migration ends, the bound runs again.
func TestMigratingVMIIsNoWedge(t *testing.T) {
	bound := time.Minute
	t0 := time.Unix(10_000, 0)
	p := newPasses(t, Config{WedgedAfter: bound, SlowAfter: time.Hour, MaxHold: time.Hour})
	p.w.intents["a"] = newIntent("vm1", "a", Attach, t0)
	vmi := vmiWith(map[string]kubevirtv1.VolumePhase{"a": kubevirtv1.HotplugVolumeAttachedToNode})
	start := metav1.NewTime(t0)
	vmi.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{StartTimestamp: &start, SourceNode: "host-a", TargetNode: "host-b"}
	o := observed{vm: vmWith([]string{"a"}), vmi: vmi}
	for i := range 10 {
		if got := p.at(t0.Add(time.Duration(i)*bound), o); len(got) != 0 {
			t.Fatalf("pass %d during the migration: %+v", i, got)
		}
	}
	if n := p.wedged()[WedgePlug]; n != 0 {
		t.Fatalf("counted wedged during the migration: %v", p.wedged())
	}
	st := p.q.State()
	if len(st) != 1 || st[0].Intents[0].Wedged != nil || !strings.Contains(st[0].Intents[0].WaitingFor, "live migration from host node host-a to host-b") {
		t.Fatalf("state %+v, want a wait naming the migration", st)
	}

	// The migration ended at t0+10 bounds; nothing moves after it.
	ended := vmi.DeepCopy()
	end := metav1.NewTime(t0.Add(10 * bound))
	ended.Status.MigrationState.EndTimestamp, ended.Status.MigrationState.Completed = &end, true
	ended.Status.NodeName = "host-b"
	after := observed{vm: vmWith([]string{"a"}), vmi: ended}
	if got := p.at(t0.Add(10*bound), after); len(got) != 0 {
		t.Fatalf("wedged right as the migration ended: %+v", got)
	}
	if got := p.at(t0.Add(11*bound+time.Second), after); len(got) != 1 || got[0].Cleared {
		t.Fatalf("notices a bound after the migration %+v, want the wedge", got)
	}
}
