package hotplug

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Config tunes the queue. Zero fields take the defaults of DefaultConfig.
type Config struct {
	// Namespace of the VMs on the host cluster. Required.
	Namespace string
	// Workers is how many VMs are worked on at once.
	Workers int
	// BatchWindow is how long the first intent on an idle VM waits for more.
	BatchWindow time.Duration
	// MaxHold bounds how long a VM is left alone while KubeVirt settles the
	// previous change, and how long a write may go unobserved.
	MaxHold time.Duration
	// MaxConflictRetries bounds the immediate retries after a conflict before
	// the VM is requeued with backoff.
	MaxConflictRetries int
	// BackoffBase and BackoffMax bound the per-VM exponential backoff.
	BackoffBase, BackoffMax time.Duration
	// QPS and Burst form the token bucket shared by all VMs' retries.
	QPS   float64
	Burst int
	// RequestTimeout bounds one attempt at the host (a backend Apply, a live
	// read), so a host API that hangs surfaces as an error within seconds.
	RequestTimeout time.Duration
	// SlowAfter is how long an intent may wait for the same thing before the
	// queue says so in its log at the default level.
	SlowAfter time.Duration
	// Identity names this controller process in the reservations it
	// writes on host PVCs. Two processes that run at once must not share
	// it; a restarted process that keeps it (the pod's name) goes on under
	// its predecessor's reservations instead of waiting for them to expire.
	Identity string
	// ReservationFresh is how old a reservation of this process may be
	// when an attach is written under it; an older one is renewed first.
	ReservationFresh time.Duration
	// ReservationTTL is when another VM may take over a reservation whose
	// VM does not hold the volume. It must cover the holder's whole
	// window for writing (ReservationFresh + RequestTimeout) plus the
	// clock difference between controller hosts; the default leaves 10s
	// for that.
	ReservationTTL time.Duration
}

// DefaultConfig holds the defaults the command line uses.
func DefaultConfig() Config {
	return Config{
		Workers:            10,
		BatchWindow:        200 * time.Millisecond,
		MaxHold:            30 * time.Second,
		MaxConflictRetries: 5,
		BackoffBase:        200 * time.Millisecond,
		BackoffMax:         time.Minute,
		QPS:                10,
		Burst:              20,
		RequestTimeout:     15 * time.Second,
		SlowAfter:          time.Minute,
		Identity:           defaultIdentity(),
		ReservationFresh:   5 * time.Second,
	}
}

// clockAllowance is what the default ReservationTTL adds to the holder's
// window for writing: the clocks of two controller hosts may disagree by
// that much (and an API server may still carry out a write for a moment
// after its client gave up on it).
const clockAllowance = 10 * time.Second

// defaultIdentity is the host name: a pod's name, which a container restart
// keeps and a rolling update or a second replica does not share.
func defaultIdentity() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return h
	}
	return "harvester-csi-driver"
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	orDefault(&c.Workers, d.Workers)
	orDefault(&c.BatchWindow, d.BatchWindow)
	orDefault(&c.MaxHold, d.MaxHold)
	orDefault(&c.MaxConflictRetries, d.MaxConflictRetries)
	orDefault(&c.BackoffBase, d.BackoffBase)
	orDefault(&c.BackoffMax, d.BackoffMax)
	orDefault(&c.QPS, d.QPS)
	orDefault(&c.Burst, d.Burst)
	orDefault(&c.RequestTimeout, d.RequestTimeout)
	orDefault(&c.SlowAfter, d.SlowAfter)
	orDefault(&c.ReservationFresh, d.ReservationFresh)
	orDefault(&c.ReservationTTL, c.ReservationFresh+c.RequestTimeout+clockAllowance)
	if c.Identity == "" {
		c.Identity = d.Identity
	}
	return c
}

func orDefault[T int | float64 | time.Duration](v *T, d T) {
	if *v <= 0 {
		*v = d
	}
}

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
	// release: a detach was answered without an intent.
	release map[string]bool
}

type waitState struct {
	why    string
	since  time.Time
	logged bool // said in the log at the default level
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

// ErrNotReady answers calls that come before the informers have synced.
var ErrNotReady = errors.New("hotplug queue not ready: the host's VM and VMI caches have not synced yet")

// Attach blocks until the volume is observed attached to the VM, the intent is
// superseded or rejected, or ctx ends. On ctx's end the intent stays queued,
// so a retry joins the work in flight. exclusive refuses a volume that another
// VM holds, both now and again right before the attach is written.
func (q *Queue) Attach(ctx context.Context, vm, volume string, exclusive bool) error {
	if !q.Ready() {
		return ErrNotReady
	}
	key := q.key(vm)
	obs := q.observe(key)
	q.mu.Lock()
	w := q.vmWork(key)
	it := w.intents[volume]
	_, expecting := w.expect[volume]
	if !expecting && obs.attached(volume) {
		// Already there: answer at once and cancel a detach not yet written.
		if it != nil && it.op == Detach {
			q.supersedeLocked(ctx, w, it, Attach)
		} else if it != nil {
			q.finishLocked(w, it, nil)
		}
		q.dropIfIdleLocked(key)
		q.mu.Unlock()
		return nil
	}
	if exclusive {
		if err := q.heldElsewhereLocked(key, volume); err != nil {
			q.dropIfIdleLocked(key)
			q.mu.Unlock()
			return err
		}
	}
	it = q.setIntentLocked(ctx, w, key, volume, Attach)
	it.exclusive = it.exclusive || exclusive
	failed := w.failed
	q.mu.Unlock()
	return q.await(ctx, key, it, failed)
}

// Detach blocks until the volume is observed gone from the VM and its VMI, the
// intent is superseded or rejected, or ctx ends (the intent stays queued).
func (q *Queue) Detach(ctx context.Context, vm, volume string) error {
	return q.detach(ctx, vm, volume, time.Time{})
}

// DetachBefore is Detach for a caller whose right to detach ends at deadline
// (the guest node monitor, whose lease may pass to another replica then).
// The change goes to the host only before deadline: it is checked right
// before each attempt, and the attempt's requests carry the deadline. After
// it, unless a caller without a deadline joined, the intent is dropped and its
// callers get an ExpiredError; a caller gone on ctx's end leaves the intent
// queued until then, never longer.
func (q *Queue) DetachBefore(ctx context.Context, vm, volume string, deadline time.Time) error {
	if deadline.IsZero() {
		return errors.New("hotplug: DetachBefore needs a deadline")
	}
	return q.detach(ctx, vm, volume, deadline)
}

func (q *Queue) detach(ctx context.Context, vm, volume string, until time.Time) error {
	if !q.Ready() {
		return ErrNotReady
	}
	key := q.key(vm)
	obs := q.observe(key)
	q.mu.Lock()
	w := q.vmWork(key)
	_, expecting := w.expect[volume]
	if !expecting && obs.detached(volume) {
		// Nothing of ours is in flight and nothing is there: cancel a
		// not-yet-written attach and answer at once. A reservation this
		// process may still have (an attach superseded before its write,
		// a VM deleted with its VMI) is released by the VM's worker, which
		// alone writes the VM, so the release never overtakes a write.
		if it := w.intents[volume]; it != nil {
			q.supersedeLocked(ctx, w, it, Detach)
		}
		w.release[volume] = true
		q.wq.Add(key)
		q.dropIfIdleLocked(key)
		q.mu.Unlock()
		return nil
	}
	prev := w.intents[volume]
	joined := prev != nil && prev.op == Detach
	it := q.setIntentLocked(ctx, w, key, volume, Detach)
	switch {
	case until.IsZero():
		it.until = time.Time{}
	case !joined, !it.until.IsZero() && it.until.Before(until):
		it.until = until
	}
	failed := w.failed
	q.mu.Unlock()
	return q.await(ctx, key, it, failed)
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

// supersedeLocked answers an intent's callers that a newer, opposite intent
// (by) replaced it.
func (q *Queue) supersedeLocked(ctx context.Context, w *vmWork, it *intent, by Op) {
	klog.FromContext(ctx).V(2).Info("intent superseded", "vm", it.vm, "volume", it.volume, "old", it.op, "new", by)
	q.metrics.superseded.Inc()
	q.finishLocked(w, it, &SupersededError{Volume: it.volume, VM: it.vm, By: by})
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
		w = &vmWork{intents: map[string]*intent{}, expect: map[string]expectation{}, waiting: map[string]waitState{}, release: map[string]bool{}, failed: make(chan struct{})}
		q.work[key] = w
	}
	return w
}

func (q *Queue) dropIfIdleLocked(key cache.ObjectName) {
	if w := q.work[key]; w != nil && len(w.intents) == 0 && len(w.expect) == 0 && len(w.release) == 0 {
		delete(q.work, key)
	}
}

// setIntentLocked records the latest intent for (vm, volume): an equal intent
// is joined, an opposite one is answered as superseded and replaced.
func (q *Queue) setIntentLocked(ctx context.Context, w *vmWork, key cache.ObjectName, volume string, op Op) *intent {
	if it := w.intents[volume]; it != nil {
		if it.op == op {
			return it
		}
		q.supersedeLocked(ctx, w, it, op)
	}
	now := q.now()
	idle := len(w.intents) == 0
	it := newIntent(key.Name, volume, op, now)
	w.intents[volume] = it
	klog.FromContext(ctx).V(2).Info("intent queued", "vm", key.Name, "volume", volume, "op", op)
	if idle && w.gatherUntil.Before(now) {
		w.gatherUntil = now.Add(q.cfg.BatchWindow)
		q.wq.AddAfter(key, q.cfg.BatchWindow)
	} else {
		q.wq.Add(key)
	}
	return it
}

func newIntent(vm, volume string, op Op, now time.Time) *intent {
	return &intent{vm: vm, volume: volume, op: op, created: now, done: make(chan struct{})}
}

// finishLocked answers every caller of it and forgets it.
func (q *Queue) finishLocked(w *vmWork, it *intent, err error) {
	if w.intents[it.volume] == it {
		delete(w.intents, it.volume)
	}
	select {
	case <-it.done:
		return
	default:
	}
	it.err = err
	// The figures go in before the callers hear: what a caller sees once
	// answered (the metrics endpoint, a test) includes its own intent.
	if err == nil {
		now := q.now()
		q.metrics.completion.WithLabelValues(it.op.String()).Observe(now.Sub(it.created).Seconds())
		if !it.written.IsZero() {
			held, _ := it.split(now)
			q.metrics.held.WithLabelValues(it.op.String()).Observe(held.Seconds())
		}
	}
	close(it.done)
}

// split divides an intent's time until now into the part the queue held it
// (until its last write) and the part the host took after that; an intent
// never written was held all along.
func (it *intent) split(now time.Time) (held, host time.Duration) {
	if it.written.IsZero() {
		return now.Sub(it.created), 0
	}
	return it.written.Sub(it.created), now.Sub(it.written)
}

// await waits for it to finish. A caller whose deadline comes first, or whose
// VM's attempts fail in a way retrying cannot cure, gets the VM's last
// failure as the cause; the intent stays either way, so the retry joins it.
func (q *Queue) await(ctx context.Context, key cache.ObjectName, it *intent, failed <-chan struct{}) error {
	select {
	case <-it.done:
		return it.err
	case <-q.stopped:
		return fmt.Errorf("%s of volume %s on VM %s: %w", it.op, it.volume, it.vm, ErrStopped)
	case <-ctx.Done():
	case <-failed:
	}
	select {
	case <-it.done:
		return it.err
	default:
	}
	q.mu.Lock()
	var cause error
	var since time.Time
	var wait waitState
	if w := q.work[key]; w != nil {
		cause, since, wait = w.lastErr, w.failingSince, w.waiting[it.volume]
	}
	now := q.now()
	q.mu.Unlock()
	if cause != nil {
		return &StalledError{Volume: it.volume, VM: it.vm, Op: it.op, Cause: cause, Since: since}
	}
	if wait.why != "" {
		return fmt.Errorf("%s of volume %s on VM %s still in progress, %s for %s: %w",
			it.op, it.volume, it.vm, wait.why, now.Sub(wait.since).Round(time.Second), ctx.Err())
	}
	return fmt.Errorf("%s of volume %s on VM %s still in progress: %w", it.op, it.volume, it.vm, ctx.Err())
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
