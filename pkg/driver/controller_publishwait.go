package driver

import (
	"context"
	"sync"
	"time"

	"k8s.io/klog/v2"
)

// Defaults of --publish-wait and --publish-wait-crowd. The external-attacher
// gives every ControllerPublish/Unpublish one of its workers for as long as
// the call lasts (--worker-threads, 10 by default: external-attacher v4.12.0
// cmd/csi-attacher/main.go), and retries an "in progress" answer with its own
// backoff per VolumeAttachment (--retry-interval-start 1s, doubling up to
// --retry-interval-max 5m). A call that waits for KubeVirt while few are
// waiting costs nothing and is answered as soon as the VM shows the result;
// once DefaultPublishWaitCrowd calls wait at once, the attacher may have no
// worker left for the rest of a wave, whose volumes would then reach the queue
// one hotplug cycle after another. So from that many on, a call that has
// waited DefaultPublishWait answers "in progress": its intent stays queued,
// its worker takes the next volume, and the retry finds the work done.
// docs/benchmarks.md ("Publish wait and the attacher's workers") has the
// measurements behind both figures.
const (
	DefaultPublishWait      = 3 * time.Second
	DefaultPublishWaitCrowd = 5
)

// waiting counts the publishes and unpublishes of one controller process
// that are waiting for the hotplug queue, and remembers which calls the
// crowd freed.
type waiting struct {
	mu sync.Mutex
	n  int
	// changed is closed, and replaced, whenever n changes.
	changed chan struct{}
	// freed holds the operations (op, volume, VM) whose last call the
	// crowd answered "in progress". Their intent is queued, so the retry
	// waits up to its deadline: the external-attacher doubles its backoff
	// after every error, and a second short answer would make the caller
	// see the result up to twice as late as the work is done. An entry
	// goes with the operation's next call.
	freed map[string]bool
}

func newWaiting() *waiting { return &waiting{changed: make(chan struct{}), freed: map[string]bool{}} }

// retry says whether the crowd freed the last call of op, and forgets it.
func (w *waiting) retry(op string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	was := w.freed[op]
	delete(w.freed, op)
	return was
}

// maxFreed bounds freed: an operation whose caller gave up (its
// VolumeAttachment deleted) is never called again. Forgetting them all at
// once costs at most one more short answer each.
const maxFreed = 4096

func (w *waiting) remember(op string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.freed) >= maxFreed {
		clear(w.freed)
	}
	w.freed[op] = true
}

func (w *waiting) add(d int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.n += d
	close(w.changed)
	w.changed = make(chan struct{})
}

func (w *waiting) state() (int, <-chan struct{}) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.n, w.changed
}

// leaveIfCrowded stops counting one call when at least crowd are waiting,
// and says whether it did. Taking the call out under the same lock as the
// test lets only as many calls go as make the crowd smaller than crowd,
// however many check at once.
func (w *waiting) leaveIfCrowded(crowd int) (bool, <-chan struct{}) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.n < crowd {
		return false, w.changed
	}
	w.n--
	close(w.changed)
	w.changed = make(chan struct{})
	return true, nil
}

// publishWindow bounds how long a publish or unpublish (op) of vol on vm
// waits for the queue: up to the caller's
// deadline less the margin, and no longer than PublishWait once
// PublishWaitCrowd calls (this one included) wait at once, unless the crowd
// freed the last call of the same op, vol and vm. A crowd of 1 or less makes PublishWait a plain
// bound. The context ends with DeadlineExceeded either way, which the caller
// sees as "in progress".
func (s *controllerService) publishWindow(ctx context.Context, op, vol, vm string) (context.Context, context.CancelFunc) {
	ctx, cancel := s.withMargin(ctx)
	wait, crowd := s.opts.PublishWait, s.opts.PublishWaitCrowd
	if wait <= 0 {
		return ctx, cancel
	}
	if crowd <= 1 {
		short, cancelShort := context.WithTimeout(ctx, wait)
		return short, func() { cancelShort(); cancel() }
	}
	key := op + " " + vol + " " + vm
	s.waiting.add(1)
	if s.waiting.retry(key) {
		// Counted, so that first calls beside it are freed, but not freed.
		return ctx, func() { cancel(); s.waiting.add(-1) }
	}
	c := &crowdedContext{Context: ctx, done: make(chan struct{})}
	go c.watch(ctx, s.waiting, wait, crowd)
	return c, func() {
		cancel() // ends watch
		<-c.done
		if c.freed() {
			s.waiting.remember(key)
			klog.FromContext(ctx).V(2).Info("answering \"in progress\" to free the caller's worker: the crowd of waiting calls is full",
				"op", op, "volume", vol, "vm", vm, "wait", wait, "crowd", crowd)
		} else {
			s.waiting.add(-1)
		}
	}
}

// crowdedContext is ctx ended early, with DeadlineExceeded, once its call
// has waited long enough while the controller is crowded. The standard
// library cannot bring a context's deadline forward after it was handed
// out, and the queue reports ctx.Err() as the reason a call is unfinished.
type crowdedContext struct {
	context.Context
	done    chan struct{}
	mu      sync.Mutex
	err     error
	crowded bool // ended by the crowd, not by its parent
}

func (c *crowdedContext) Done() <-chan struct{} { return c.done }

func (c *crowdedContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// freed says whether the crowd ended c (the call no longer counts).
func (c *crowdedContext) freed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.crowded
}

func (c *crowdedContext) end(err error) {
	c.mu.Lock()
	c.err = err
	c.mu.Unlock()
	close(c.done)
}

// watch ends c when parent ends, or once wait has passed and at least crowd
// calls are waiting; a call that waited alone is freed as soon as the crowd
// forms, so workers held since before a wave are freed too. Calls are freed
// one at a time until fewer than crowd wait: those keep waiting for KubeVirt.
func (c *crowdedContext) watch(parent context.Context, w *waiting, wait time.Duration, crowd int) {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-parent.Done():
		c.end(parent.Err())
		return
	case <-timer.C:
	}
	for {
		left, changed := w.leaveIfCrowded(crowd)
		if left {
			c.mu.Lock()
			c.crowded = true
			c.mu.Unlock()
			c.end(context.DeadlineExceeded)
			return
		}
		select {
		case <-parent.Done():
			c.end(parent.Err())
			return
		case <-changed:
		}
	}
}
