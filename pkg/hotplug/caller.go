package hotplug

// The caller's side of the queue: Attach, Detach and DetachBefore record an
// intent and wait for it (await) until the worker's pass (sync.go) or a newer
// intent finishes it.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// ErrNotReady answers calls that come before the queue runs: its backend
// still learning the host's hotplug path, or its informers still syncing.
var ErrNotReady = errors.New("hotplug queue not ready: its backend does not know the host's hotplug path yet, or the host's VM and VMI caches have not synced yet")

// Errors of Attach, Detach and DetachBefore. Each call returns nil once the
// informers show the change done, or one of these, and nothing else (match
// with errors.Is / errors.As; pkg/driver maps each to a gRPC code):
//
//   - ErrNotReady: the queue does not run yet; nothing was queued.
//   - ErrStopped (wrapped): the queue stopped while the caller waited; the
//     intent died with it.
//   - *HeldError: an exclusive attach whose volume another VM holds (now, or
//     right before the write); final for this intent.
//   - *SupersededError: a newer, opposite intent for the same volume and VM
//     replaced this one.
//   - *RejectedError: the host refused the change for good (a webhook, an
//     invalid volume); Unwrap gives the host's answer, wrapped in ErrVMFull
//     when it is KubeVirt's limit on a VM's disks.
//   - *VMFullError (Attach only; errors.Is ErrVMFull): the VM has
//     Config.MaxDisks disks already; nothing was written.
//   - *ClaimNotReadyError (Attach only): the host PVC is gone (Phase empty)
//     or not Bound.
//   - *VMNotFoundError (Attach only; errors.Is ErrVMNotFound): the API
//     server says the VM does not exist.
//   - *ExpiredError (DetachBefore and DetachUnwantedBefore only): its
//     deadline passed before the detach was written.
//   - ErrWanted (wrapped; DetachUnwantedBefore only): this process has an
//     attach of the volume to the VM pending or not yet observed; nothing
//     was queued.
//   - *StalledError: ctx ended, or the host refused the driver's identity,
//     while the VM's last attempt at the host had failed; the intent stays
//     queued. Unwrap gives the host's error.
//   - *WedgedError (Unwrap gives ctx.Err()): ctx ended while the intent
//     was wedged in KubeVirt (Config.WedgedAfter); it stays queued, and a
//     retry joins it.
//   - ctx.Err() (wrapped, saying what the intent waits for): ctx ended
//     while the intent was still in progress; it stays queued, and a retry
//     joins it. For an exclusive attach it may also end the wait for this
//     process's detach of the volume from another VM, before anything was
//     queued.

// Attach blocks until the volume is observed attached to the VM, the intent is
// superseded or rejected, or ctx ends (the errors are listed at ErrNotReady).
// On ctx's end the intent stays queued, so a retry joins the work in flight.
// exclusive refuses a volume that another VM holds, both now and again right
// before the attach is written.
func (q *Queue) Attach(ctx context.Context, vm, volume string, exclusive bool) error {
	if !q.Ready() {
		return ErrNotReady
	}
	key := q.key(vm)
	if exclusive {
		if err := q.awaitRelease(ctx, key, volume); err != nil {
			return err
		}
	}
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

// awaitRelease waits while this process is detaching volume from another VM:
// an exclusive attach moving the volume there would only be refused as held
// until then, and the caller (the external-attacher) would come back after
// its own backoff, seconds after the volume is free. Nothing is queued while
// it waits; once no detach of ours is left, the attach goes on and is fenced
// as ever.
func (q *Queue) awaitRelease(ctx context.Context, key cache.ObjectName, volume string) error {
	for {
		q.mu.Lock()
		other, released := q.releasingLocked(key, volume)
		q.mu.Unlock()
		if released == nil {
			return nil
		}
		klog.FromContext(ctx).V(2).Info("attach waits for the volume's detach from another VM", "vm", key.Name, "volume", volume, "holder", other)
		select {
		case <-released:
		case <-ctx.Done():
			return fmt.Errorf("attach of volume %s to VM %s: waiting for its detach from VM %s: %w", volume, key.Name, other, ctx.Err())
		}
	}
}

// releasingLocked returns another VM with a detach intent of volume and the
// channel closed when that intent ends, or nil.
func (q *Queue) releasingLocked(key cache.ObjectName, volume string) (string, <-chan struct{}) {
	for _, other := range sortedNames(q.work) {
		if other == key {
			continue
		}
		if it := q.work[other].intents[volume]; it != nil && it.op == Detach {
			return other.Name, it.done
		}
	}
	return "", nil
}

// Detach blocks until the volume is observed gone from the VM and its VMI, the
// intent is superseded or rejected, or ctx ends (the intent stays queued;
// the errors are listed at ErrNotReady).
func (q *Queue) Detach(ctx context.Context, vm, volume string) error {
	return q.detach(ctx, vm, volume, time.Time{}, false)
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
	return q.detach(ctx, vm, volume, deadline, false)
}

// ErrWanted refuses to detach a volume nobody asked to detach while this
// process is attaching it to the same VM.
var ErrWanted = errors.New("an attach of the volume to this VM is pending or not yet observed")

// DetachUnwantedBefore is DetachBefore for a detach no CSI caller asked for
// (an orphaned hot-plug): it is refused with ErrWanted, under the same lock
// that queues intents, while this process has an attach of the volume to
// the VM pending or written but not yet observed. A publish in progress has
// no VolumeAttachment in the guest only when someone calls the driver
// without one, and it must win: the other way round, the detach would
// supersede it. An attach that comes after supersedes this detach, as any
// newer intent does.
func (q *Queue) DetachUnwantedBefore(ctx context.Context, vm, volume string, deadline time.Time) error {
	if deadline.IsZero() {
		return errors.New("hotplug: DetachUnwantedBefore needs a deadline")
	}
	return q.detach(ctx, vm, volume, deadline, true)
}

func (q *Queue) detach(ctx context.Context, vm, volume string, until time.Time, unlessWanted bool) error {
	if !q.Ready() {
		return ErrNotReady
	}
	key := q.key(vm)
	obs := q.observe(key)
	q.mu.Lock()
	w := q.vmWork(key)
	e, expecting := w.expect[volume]
	if it := w.intents[volume]; unlessWanted && (it != nil && it.op == Attach || expecting && e.op == Attach) {
		q.dropIfIdleLocked(key)
		q.mu.Unlock()
		return fmt.Errorf("volume %s on VM %s: %w", volume, vm, ErrWanted)
	}
	if !expecting && obs.detached(volume) {
		// Nothing of ours is in flight and nothing is there: cancel a
		// not-yet-written attach and answer once a reservation this
		// process may still have (an attach superseded before its write,
		// a VM deleted with its VMI) is released. The VM's worker releases
		// it, since it alone writes the VM and so the release never
		// overtakes a write; the answer waits for that, as every detach's
		// does, so a caller moving the volume to another VM next does not
		// find it still reserved here.
		if it := w.intents[volume]; it != nil {
			q.supersedeLocked(ctx, w, it, Detach)
		}
		released, ok := w.release[volume]
		if !ok {
			released = make(chan struct{})
			w.release[volume] = released
		}
		q.wq.Add(key)
		q.mu.Unlock()
		select {
		case <-released:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("detach of volume %s on VM %s: waiting for its reservation to be released: %w", volume, vm, ctx.Err())
		}
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

// supersedeLocked answers an intent's callers that a newer, opposite intent
// (by) replaced it.
func (q *Queue) supersedeLocked(ctx context.Context, w *vmWork, it *intent, by Op) {
	klog.FromContext(ctx).V(2).Info("intent superseded", "vm", it.vm, "volume", it.volume, "old", it.op, "new", by)
	q.metrics.superseded.Inc()
	q.finishLocked(w, it, &SupersededError{Volume: it.volume, VM: it.vm, By: by})
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
		if w.waiting[it.volume].wedged {
			// Only the worker's pass reports a wedge's end (outside the
			// lock); a caller answered here must not leave it unsaid.
			q.wq.Add(q.key(it.vm))
		}
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
	if wait.wedged {
		return &WedgedError{Volume: it.volume, VM: it.vm, Op: it.op, Wedge: wait.wedge, For: now.Sub(wait.still), Err: ctx.Err()}
	}
	if wait.why != "" {
		return fmt.Errorf("%s of volume %s on VM %s still in progress, %s for %s: %w",
			it.op, it.volume, it.vm, wait.why, now.Sub(wait.since).Round(time.Second), ctx.Err())
	}
	return fmt.Errorf("%s of volume %s on VM %s still in progress: %w", it.op, it.volume, it.vm, ctx.Err())
}
