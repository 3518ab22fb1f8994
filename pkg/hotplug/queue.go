package hotplug

import (
	"context"
	"errors"
	"fmt"
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
	// Namespace of the VMs on the host cluster.
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
	}
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
	vms     cache.Indexer
	vmis    cache.Indexer
	synced  []cache.InformerSynced
	wq      workqueue.TypedRateLimitingInterface[string]
	metrics *metrics
	now     func() time.Time

	// stopped is closed when Run returns, releasing every waiting caller.
	stopped chan struct{}

	mu   sync.Mutex
	work map[string]*vmWork // by VM name; only VMs with intents or expectations
}

// ErrStopped answers callers still waiting when the queue stops; the intent
// dies with the process, and the caller's retry reaches the next one.
var ErrStopped = errors.New("hotplug queue stopped")

// vmWork is the queue's memory for one VM. Only intents live here: what is
// attached where always comes from the informers.
type vmWork struct {
	intents map[string]*intent // by volume
	// expect holds writes this process made that the informers have not shown
	// yet; while one is outstanding its volume is neither written nor judged.
	expect map[string]expectation
	// gatherUntil ends the batching window of the VM's first intent.
	gatherUntil time.Time
	// settlingSince starts when the queue writes the VM or first sees it
	// settling, and bounds how long it is held (MaxHold).
	settlingSince time.Time
}

type expectation struct {
	op    Op
	since time.Time
}

type intent struct {
	vm, volume string
	op         Op
	created    time.Time
	done       chan struct{} // closed when err is final
	err        error
}

const (
	indexClaim = "claim"
)

// New builds a queue over VM and VMI informers of the host namespace. It adds
// an index to both informers, so call it before they start.
func New(cfg Config, backend Backend, vmInformer, vmiInformer cache.SharedIndexInformer, reg Registerer) (*Queue, error) {
	cfg = cfg.withDefaults()
	if err := vmInformer.AddIndexers(cache.Indexers{indexClaim: func(obj any) ([]string, error) {
		vm, ok := obj.(*kubevirtv1.VirtualMachine)
		if !ok {
			return nil, nil
		}
		return vmClaims(vm), nil
	}}); err != nil {
		return nil, fmt.Errorf("add VM claim index: %w", err)
	}
	if err := vmiInformer.AddIndexers(cache.Indexers{indexClaim: func(obj any) ([]string, error) {
		vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance)
		if !ok {
			return nil, nil
		}
		return vmiClaims(vmi), nil
	}}); err != nil {
		return nil, fmt.Errorf("add VMI claim index: %w", err)
	}
	limiter := workqueue.NewTypedMaxOfRateLimiter(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.BackoffBase, cfg.BackoffMax),
		&workqueue.TypedBucketRateLimiter[string]{Limiter: rate.NewLimiter(rate.Limit(cfg.QPS), cfg.Burst)},
	)
	q := &Queue{
		cfg:     cfg,
		backend: backend,
		vms:     vmInformer.GetIndexer(),
		vmis:    vmiInformer.GetIndexer(),
		synced:  []cache.InformerSynced{vmInformer.HasSynced, vmiInformer.HasSynced},
		wq:      workqueue.NewTypedRateLimitingQueueWithConfig(limiter, workqueue.TypedRateLimitingQueueConfig[string]{Name: "hotplug"}),
		now:     time.Now,
		stopped: make(chan struct{}),
		work:    map[string]*vmWork{},
	}
	q.metrics = newMetrics(q, backend.Name())
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

// wake re-examines a VM when the informers show it changed, but only if the
// queue has business with it.
func (q *Queue) wake(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	var name string
	switch o := obj.(type) {
	case *kubevirtv1.VirtualMachine:
		name = o.Name
	case *kubevirtv1.VirtualMachineInstance:
		name = o.Name
	default:
		return
	}
	q.mu.Lock()
	_, busy := q.work[name]
	q.mu.Unlock()
	if busy {
		q.wq.Add(name)
	}
}

// Run waits for the informers to sync, then works the queue until ctx ends.
func (q *Queue) Run(ctx context.Context) error {
	defer close(q.stopped)
	defer q.wq.ShutDown()
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
	<-ctx.Done()
	q.wq.ShutDown()
	wg.Wait()
	return nil
}

func (q *Queue) worker(ctx context.Context) {
	for q.processNext(ctx) {
	}
}

func (q *Queue) processNext(ctx context.Context) bool {
	vm, shutdown := q.wq.Get()
	if shutdown {
		return false
	}
	defer q.wq.Done(vm)
	logger := klog.FromContext(ctx).WithValues("vm", vm)
	if err := q.sync(klog.NewContext(ctx, logger), vm); err != nil {
		logger.Error(err, "hotplug sync failed, retrying with backoff")
		q.wq.AddRateLimited(vm)
		return true
	}
	q.wq.Forget(vm)
	return true
}

// Attach blocks until the volume is observed attached to the VM, the intent is
// superseded or rejected, or ctx ends. On ctx's end the intent stays queued,
// so a retry joins the work in flight. exclusive refuses a volume that another
// VM holds.
func (q *Queue) Attach(ctx context.Context, vm, volume string, exclusive bool) error {
	obs := q.observe(vm)
	if obs.gone() {
		// The informer may lag a VM created a moment ago: ask the API server.
		exists, err := q.backend.Exists(ctx, vm)
		if err != nil {
			return fmt.Errorf("look up VM %s: %w", vm, err)
		}
		if !exists {
			return ErrVMNotFound
		}
	}
	q.mu.Lock()
	w := q.vmWork(vm)
	it := w.intents[volume]
	_, expecting := w.expect[volume]
	if !expecting && obs.attached(volume) {
		// Already there: answer at once and cancel a detach not yet written.
		if it != nil && it.op == Detach {
			q.supersedeLocked(ctx, w, it, Attach)
		} else if it != nil {
			q.finishLocked(w, it, nil)
		}
		q.dropIfIdleLocked(vm)
		q.mu.Unlock()
		return nil
	}
	if exclusive {
		if err := q.heldElsewhereLocked(vm, volume); err != nil {
			q.dropIfIdleLocked(vm)
			q.mu.Unlock()
			return err
		}
	}
	it = q.setIntentLocked(ctx, w, vm, volume, Attach)
	q.mu.Unlock()
	return q.await(ctx, it)
}

// Detach blocks until the volume is observed gone from the VM and its VMI, the
// intent is superseded or rejected, or ctx ends (the intent stays queued).
func (q *Queue) Detach(ctx context.Context, vm, volume string) error {
	obs := q.observe(vm)
	q.mu.Lock()
	w := q.vmWork(vm)
	_, expecting := w.expect[volume]
	if !expecting && obs.detached(volume) {
		// Nothing of ours is in flight and nothing is there: cancel a
		// not-yet-applied attach and answer at once.
		if it := w.intents[volume]; it != nil {
			q.supersedeLocked(ctx, w, it, Detach)
		}
		q.dropIfIdleLocked(vm)
		q.mu.Unlock()
		return nil
	}
	it := q.setIntentLocked(ctx, w, vm, volume, Detach)
	q.mu.Unlock()
	return q.await(ctx, it)
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
		if !ok || (q.cfg.Namespace != "" && vmi.Namespace != q.cfg.Namespace) {
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
		o := q.observe(vmi.Name)
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

// heldElsewhereLocked refuses an exclusive attach while another VM holds the
// volume in its spec, its VMI or a pending attach intent of this process.
func (q *Queue) heldElsewhereLocked(vm, volume string) error {
	for _, other := range q.Holders(volume) {
		if other == vm {
			continue
		}
		state := q.observe(other).holdState(volume)
		if state == "" {
			state = "attached"
		}
		return &HeldError{Volume: volume, VM: other, State: state}
	}
	for other, w := range q.work {
		if other == vm {
			continue
		}
		if it := w.intents[volume]; it != nil && it.op == Attach {
			return &HeldError{Volume: volume, VM: other, State: "attaching"}
		}
	}
	return nil
}

func (q *Queue) vmWork(vm string) *vmWork {
	w := q.work[vm]
	if w == nil {
		w = &vmWork{intents: map[string]*intent{}, expect: map[string]expectation{}}
		q.work[vm] = w
	}
	return w
}

func (q *Queue) dropIfIdleLocked(vm string) {
	if w := q.work[vm]; w != nil && len(w.intents) == 0 && len(w.expect) == 0 {
		delete(q.work, vm)
	}
}

// setIntentLocked records the latest intent for (vm, volume): an equal intent
// is joined, an opposite one is answered as superseded and replaced.
func (q *Queue) setIntentLocked(ctx context.Context, w *vmWork, vm, volume string, op Op) *intent {
	if it := w.intents[volume]; it != nil {
		if it.op == op {
			return it
		}
		q.supersedeLocked(ctx, w, it, op)
	}
	now := q.now()
	idle := len(w.intents) == 0
	it := newIntent(vm, volume, op, now)
	w.intents[volume] = it
	klog.FromContext(ctx).V(2).Info("intent queued", "vm", vm, "volume", volume, "op", op)
	if idle && w.gatherUntil.Before(now) {
		w.gatherUntil = now.Add(q.cfg.BatchWindow)
		q.wq.AddAfter(vm, q.cfg.BatchWindow)
	} else {
		q.wq.Add(vm)
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
	close(it.done)
	if err == nil {
		q.metrics.completion.WithLabelValues(it.op.String()).Observe(q.now().Sub(it.created).Seconds())
	}
}

func (q *Queue) await(ctx context.Context, it *intent) error {
	select {
	case <-it.done:
		return it.err
	case <-ctx.Done():
		return fmt.Errorf("%s of volume %s on VM %s still in progress: %w", it.op, it.volume, it.vm, ctx.Err())
	case <-q.stopped:
		return fmt.Errorf("%s of volume %s on VM %s: %w", it.op, it.volume, it.vm, ErrStopped)
	}
}

func (q *Queue) observe(vm string) observed {
	var o observed
	key := vm
	if q.cfg.Namespace != "" {
		key = q.cfg.Namespace + "/" + vm
	}
	if obj, ok, _ := q.vms.GetByKey(key); ok {
		o.vm, _ = obj.(*kubevirtv1.VirtualMachine)
	}
	if obj, ok, _ := q.vmis.GetByKey(key); ok {
		o.vmi, _ = obj.(*kubevirtv1.VirtualMachineInstance)
	}
	return o
}

// BackendName names the backend in use.
func (q *Queue) BackendName() string { return q.backend.Name() }
