package hotplug

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Queue is the per-VM hotplug queue. Create it with New, start it with Run.
type Queue struct {
	cfg     Config
	backend Backend
	reader  Reader
	live    *liveReads
	vms     cache.Indexer
	vmis    cache.Indexer
	synced  []cache.InformerSynced
	wq      workqueue.TypedRateLimitingInterface[cache.ObjectName]
	metrics *metrics
	now     func() time.Time

	// running is closed once the informers have synced and workers run;
	// stopped is closed when Run returns, releasing every waiting caller.
	running, stopped chan struct{}

	mu   sync.Mutex
	work map[cache.ObjectName]*vmWork // only VMs with intents or expectations
	// waiting says why the queue is not running yet.
	waiting string
	// wedges hears of wedged intents (nil: nobody).
	wedges WedgeReporter
	// claimCache seeds reservation writes (nil: every one is preceded by
	// a read).
	claimCache ClaimCache
	// launchersEnded holds, per VM, the virt-launcher pods of its VMI that
	// a live read found ended or gone, which status.activePods still names
	// (migrate.go).
	launchersEnded map[cache.ObjectName]map[types.UID]bool
}

// ErrStopped answers callers still waiting when the queue stops; the intent
// dies with the process, and the caller's retry reaches the next one.
var ErrStopped = errors.New("hotplug queue stopped")

// vmWork is the queue's memory for one VM. Only intents and this process's
// own unobserved writes live here: what is attached where always comes from
// the informers (and, before an exclusive attach is written, the API server).
type vmWork struct {
	intents map[string]*intent // by volume
	// expect holds writes this process made, or is making, that the
	// informers have not shown yet. While one is outstanding its volume is
	// neither written nor judged here, and counts as held everywhere else.
	expect map[string]expectation
	// gatherUntil ends the batching window of the VM's first intent.
	gatherUntil time.Time
	// settlingSince starts when the queue writes the VM, first sees it
	// settling, or sees KubeVirt's work on it move (progress changes), and
	// bounds how long it is held (MaxHold).
	settlingSince time.Time
	progress      string
	// stalledSince and stallMark are the plan's clock of the VM's queued
	// legacy requests (plan.stalledRequests); wokeAt is when the worker last
	// woke KubeVirt's VM controller for them.
	stalledSince time.Time
	stallMark    string
	wokeAt       time.Time
	// cycleStart is when the queue last wrote the VM other than to join,
	// and joined whether a join followed that write.
	cycleStart time.Time
	joined     bool
	// hold says why pending changes wait (empty: they don't).
	hold string
	// waiting says, per volume, what its intent waits for and since when.
	waiting map[string]waitState
	// lastErr is the last failed attempt at the host for this VM (nil after
	// a success), with when the failures began: callers still waiting get it.
	lastErr      error
	failingSince time.Time
	// failed is closed and replaced when an attempt fails in a way retrying
	// cannot cure (the host refuses our identity), waking waiting callers.
	failed chan struct{}
	// release lists volumes whose reservation for this VM the worker is to
	// release for a detach that found nothing on the VM; the channel is
	// closed once the worker has done so, and the detach answers then.
	release map[string]chan struct{}
}

type waitState struct {
	why    string
	since  time.Time
	logged bool // said in the log at the default level
	// reason is the KubeVirt step waited for (empty: the wait is the
	// queue's own and cannot wedge), mark what KubeVirt showed of it when
	// still began (the last progress), wedged whether the wait has been
	// reported wedged, with wedge its details and op the intent's.
	reason, mark string
	still        time.Time
	wedged       bool
	wedge        Wedge
	op           Op
}

type expectation struct {
	op    Op
	since time.Time
}

type intent struct {
	vm, volume string
	op         Op
	// exclusive attaches are refused while another VM holds the volume.
	exclusive bool
	created   time.Time
	// written is when this process last wrote the intent's change to the
	// host (zero: never). It splits an intent's time into the queue's hold
	// and KubeVirt's own work.
	written time.Time
	// until, when set, is the deadline of the only callers that want this
	// detach (DetachBefore): it is written only before then, and dropped
	// at the first attempt after. A caller without a deadline clears it.
	until time.Time
	done  chan struct{} // closed when err is final
	err   error
}

const indexClaim = "claim"

// New builds a queue over VM and VMI informers of the host namespace. It adds
// an index to both informers, so call it before they start.
func New(cfg Config, backend Backend, reader Reader, vmInformer, vmiInformer cache.SharedIndexInformer, reg Registerer) (*Queue, error) {
	cfg = cfg.withDefaults()
	if cfg.Namespace == "" {
		return nil, errors.New("hotplug: the host namespace is required")
	}
	if cfg.ReservationTTL < cfg.ReservationFresh+cfg.RequestTimeout {
		return nil, fmt.Errorf("hotplug: the reservation TTL %v is shorter than a holder's window for writing (%v fresh + %v request timeout)",
			cfg.ReservationTTL, cfg.ReservationFresh, cfg.RequestTimeout)
	}
	if err := vmInformer.AddIndexers(cache.Indexers{indexClaim: claimIndex(vmClaims)}); err != nil {
		return nil, fmt.Errorf("add VM claim index: %w", err)
	}
	if err := vmiInformer.AddIndexers(cache.Indexers{indexClaim: claimIndex(vmiClaims)}); err != nil {
		return nil, fmt.Errorf("add VMI claim index: %w", err)
	}
	limiter := workqueue.NewTypedMaxOfRateLimiter(
		workqueue.NewTypedItemExponentialFailureRateLimiter[cache.ObjectName](cfg.BackoffBase, cfg.BackoffMax),
		&workqueue.TypedBucketRateLimiter[cache.ObjectName]{Limiter: rate.NewLimiter(rate.Limit(cfg.QPS), cfg.Burst)},
	)
	q := &Queue{
		cfg:     cfg,
		backend: backend,
		reader:  reader,
		live:    &liveReads{reader: reader, timeout: cfg.RequestTimeout},
		vms:     vmInformer.GetIndexer(),
		vmis:    vmiInformer.GetIndexer(),
		synced:  []cache.InformerSynced{vmInformer.HasSynced, vmiInformer.HasSynced},
		wq: workqueue.NewTypedRateLimitingQueueWithConfig(limiter,
			workqueue.TypedRateLimitingQueueConfig[cache.ObjectName]{Name: "hotplug"}),
		now:     time.Now,
		running: make(chan struct{}),
		stopped: make(chan struct{}),
		work:    map[cache.ObjectName]*vmWork{},
		waiting: "starting",

		launchersEnded: map[cache.ObjectName]map[types.UID]bool{},
	}
	q.metrics = newMetrics(q)
	if reg != nil {
		if err := q.metrics.register(reg); err != nil {
			return nil, err
		}
	}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    q.wake,
		UpdateFunc: func(_, obj any) { q.wake(obj) },
		DeleteFunc: q.wake,
	}
	if _, err := vmInformer.AddEventHandler(handler); err != nil {
		return nil, err
	}
	if _, err := vmiInformer.AddEventHandler(handler); err != nil {
		return nil, err
	}
	return q, nil
}

// claimIndex indexes objects of type T by the claims claims lists.
func claimIndex[T any](claims func(*T) []string) cache.IndexFunc {
	return func(obj any) ([]string, error) {
		if o, ok := obj.(*T); ok {
			return claims(o), nil
		}
		return nil, nil
	}
}

// wake re-examines a VM when the informers show it changed, but only if the
// queue has business with it.
func (q *Queue) wake(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	o, ok := obj.(interface {
		GetNamespace() string
		GetName() string
	})
	if !ok {
		return
	}
	key := cache.ObjectName{Namespace: o.GetNamespace(), Name: o.GetName()}
	q.mu.Lock()
	_, busy := q.work[key]
	q.mu.Unlock()
	if busy {
		q.wq.Add(key)
	}
}

// Run starts the backend (which may first have to learn the host's hotplug
// path), waits for the informers to sync, then works the queue until ctx
// ends. No caller is answered before both: an empty cache would say "not
// attached" about every volume.
func (q *Queue) Run(ctx context.Context) error {
	defer close(q.stopped)
	defer q.wq.ShutDown()
	defer q.setWaiting("the hotplug queue stopped")
	const detecting = "detecting the hotplug backend"
	q.setWaiting(detecting)
	if err := q.backend.Start(ctx, func(why string) { q.setWaiting(detecting + ": " + why) }); err != nil {
		return fmt.Errorf("hotplug: start the backend: %w", err)
	}
	q.metrics.bind(q.backend.Name())
	q.pickStrategy(ctx)
	q.setWaiting("waiting for the host's VM and VMI caches to sync")
	if !cache.WaitForCacheSync(ctx.Done(), q.synced...) {
		return errors.New("hotplug: VM/VMI informers did not sync")
	}
	klog.FromContext(ctx).Info("hotplug queue running", "backend", q.backend.Name(), "workers", q.cfg.Workers,
		"batchWindow", q.cfg.BatchWindow, "maxHold", q.cfg.MaxHold)
	var wg sync.WaitGroup
	for range q.cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wait.UntilWithContext(ctx, q.worker, time.Second)
		}()
	}
	close(q.running)
	<-ctx.Done()
	q.wq.ShutDown()
	wg.Wait()
	return nil
}

// Ready reports whether the informers have synced and the workers run.
func (q *Queue) Ready() bool {
	select {
	case <-q.running:
		select {
		case <-q.stopped:
			return false
		default:
			return true
		}
	default:
		return false
	}
}

// Waiting says why the queue is not ready (the backend still learning the
// host's hotplug path, the informers still syncing); empty once it is.
func (q *Queue) Waiting() string {
	if q.Ready() {
		return ""
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.waiting
}

func (q *Queue) setWaiting(why string) {
	q.mu.Lock()
	q.waiting = why
	q.mu.Unlock()
}

func (q *Queue) worker(ctx context.Context) {
	for q.processNext(ctx) {
	}
}

func (q *Queue) processNext(ctx context.Context) bool {
	key, shutdown := q.wq.Get()
	if shutdown {
		return false
	}
	defer q.wq.Done(key)
	logger := klog.FromContext(ctx).WithValues("vm", key.Name)
	if err := q.sync(klog.NewContext(ctx, logger), key); err != nil {
		logger.Error(err, "hotplug sync failed, retrying with backoff")
		q.wq.AddRateLimited(key)
		return true
	}
	q.wq.Forget(key)
	return true
}

// Holders lists the VMs that hold, are getting or are still releasing the
// volume, from the informers.
func (q *Queue) Holders(volume string) []string {
	seen := map[string]bool{}
	for _, idx := range []cache.Indexer{q.vms, q.vmis} {
		objs, _ := idx.ByIndex(indexClaim, volume)
		for _, o := range objs {
			if m, ok := o.(interface{ GetName() string }); ok {
				seen[m.GetName()] = true
			}
		}
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// VMs lists the names of the host namespace's VMs in the informer, sorted.
func (q *Queue) VMs() []string {
	out := make([]string, 0)
	for _, obj := range q.vms.List() {
		if m, ok := obj.(interface{ GetName() string }); ok {
			out = append(out, m.GetName())
		}
	}
	slices.Sort(out)
	return out
}

// Published maps every volume attached to a VM (by the same test a finished
// attach passes) to the VMs holding it, from the informers. The attacher
// compares it with its VolumeAttachments and repairs the ones that drifted,
// such as a VMI that lost a hotplug volume the VolumeAttachment still claims.
func (q *Queue) Published() map[string][]string {
	out := map[string][]string{}
	for _, obj := range q.vmis.List() {
		vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance)
		if !ok {
			continue
		}
		// CSI volume IDs are claim names, and this driver (like upstream)
		// names the hotplug volume after its claim; other hotplugs are not ours.
		ours := map[string]bool{}
		for _, v := range vmi.Spec.Volumes {
			if c := v.PersistentVolumeClaim; c != nil && c.ClaimName == v.Name {
				ours[v.Name] = true
			}
		}
		o := q.observe(cache.MetaObjectToName(vmi))
		for _, st := range vmi.Status.VolumeStatus {
			if st.HotplugVolume != nil && ours[st.Name] && o.attached(st.Name) {
				out[st.Name] = append(out[st.Name], vmi.Name)
			}
		}
	}
	for _, vms := range out {
		slices.Sort(vms)
	}
	return out
}

// heldElsewhereLocked refuses an exclusive attach to key while another VM
// holds the volume: in its spec, its legacy request list or its VMI (as the
// informers show them), with a write of this process not yet visible in the
// informers (either way: an unobserved detach still holds it), or with a
// pending attach intent of this process.
func (q *Queue) heldElsewhereLocked(key cache.ObjectName, volume string) error {
	for _, other := range q.Holders(volume) {
		if other == key.Name {
			continue
		}
		state := q.observe(q.key(other)).holdState(volume)
		if state == "" {
			state = "attached"
		}
		return &HeldError{Volume: volume, VM: other, State: state}
	}
	for _, other := range sortedNames(q.work) {
		if other == key {
			continue
		}
		w := q.work[other]
		if e, ok := w.expect[volume]; ok {
			state := "attaching"
			if e.op == Detach {
				state = "still detaching"
			}
			return &HeldError{Volume: volume, VM: other.Name, State: state}
		}
		if it := w.intents[volume]; it != nil && it.op == Attach {
			return &HeldError{Volume: volume, VM: other.Name, State: "attaching"}
		}
	}
	return nil
}

func (q *Queue) key(vm string) cache.ObjectName {
	return cache.ObjectName{Namespace: q.cfg.Namespace, Name: vm}
}

func (q *Queue) vmWork(key cache.ObjectName) *vmWork {
	w := q.work[key]
	if w == nil {
		w = &vmWork{intents: map[string]*intent{}, expect: map[string]expectation{}, waiting: map[string]waitState{}, release: map[string]chan struct{}{}, failed: make(chan struct{})}
		q.work[key] = w
	}
	return w
}

// dropIfIdleLocked forgets a VM with nothing left to do, unless a wedge
// of it still waits for its end to be reported (finishLocked queued the VM
// for that).
func (q *Queue) dropIfIdleLocked(key cache.ObjectName) {
	if w := q.work[key]; w != nil && len(w.intents) == 0 && len(w.expect) == 0 && len(w.release) == 0 && !hasWedge(w) {
		delete(q.work, key)
	}
}

func (q *Queue) observe(key cache.ObjectName) observed {
	var o observed
	if obj, ok, _ := q.vms.GetByKey(key.String()); ok {
		o.vm, _ = obj.(*kubevirtv1.VirtualMachine)
	}
	if obj, ok, _ := q.vmis.GetByKey(key.String()); ok {
		o.vmi, _ = obj.(*kubevirtv1.VirtualMachineInstance)
	}
	return o
}

// BackendName names the backend in use.
func (q *Queue) BackendName() string { return q.backend.Name() }

func sortedNames[V any](m map[cache.ObjectName]V) []cache.ObjectName {
	keys := make([]cache.ObjectName, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b cache.ObjectName) int { return cmp.Compare(a.String(), b.String()) })
	return keys
}
