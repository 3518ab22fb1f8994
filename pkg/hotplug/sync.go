package hotplug

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"k8s.io/klog/v2"
)

// sync is one worker pass over a VM: answer what the informers show done,
// then write what is pending unless the VM must be left to settle.
func (q *Queue) sync(ctx context.Context, vm string) error {
	logger := klog.FromContext(ctx)
	obs := q.observe(vm)
	q.mu.Lock()
	w := q.work[vm]
	if w == nil {
		q.mu.Unlock()
		return nil
	}
	now := q.now()
	p := decide(now, q.cfg, w, obs, q.backend.Refusal)
	for _, r := range p.resolve {
		logger.V(2).Info("intent done", "volume", r.it.volume, "op", r.it.op, "err", r.err, "after", now.Sub(r.it.created))
		q.finishLocked(w, r.it, r.err)
	}
	for _, vol := range p.cleanup {
		// Nobody waits on this detach; it keeps the queue at the volume
		// until nothing of the refused attach is left on the VM or VMI.
		logger.Info("undoing a refused attach", "volume", vol)
		w.intents[vol] = newIntent(vm, vol, Detach, now)
	}
	if !p.wakeAt.IsZero() {
		q.wq.AddAfter(vm, p.wakeAt.Sub(now))
	}
	if len(p.changes) == 0 || p.hold != "" {
		if p.hold != "" {
			logger.V(3).Info("holding changes", "reason", p.hold, "pending", len(p.changes))
		}
		q.dropIfIdleLocked(vm)
		q.mu.Unlock()
		return nil
	}
	q.mu.Unlock()
	return q.apply(ctx, vm, p.changes)
}

// apply writes changes, retrying conflicts at once after a fresh read (the
// backend reads anew on every call) a bounded number of times.
func (q *Queue) apply(ctx context.Context, vm string, changes []Change) error {
	logger := klog.FromContext(ctx)
	pending := changes
	for attempt := 0; ; attempt++ {
		q.metrics.batchSize.Observe(float64(len(pending)))
		logger.V(2).Info("applying hotplug changes", "backend", q.backend.Name(), "changes", fmtChanges(pending), "attempt", attempt)
		start := q.now()
		outs := q.backend.Apply(ctx, vm, pending)
		q.metrics.applyDuration.Observe(q.now().Sub(start).Seconds())
		if len(outs) != len(pending) {
			return fmt.Errorf("backend %s answered %d outcomes for %d changes", q.backend.Name(), len(outs), len(pending))
		}
		retry, failed := q.record(ctx, vm, pending, outs)
		if failed != nil {
			return failed
		}
		if len(retry) == 0 {
			q.wq.AddAfter(vm, q.cfg.MaxHold) // in case no informer event ever shows the result
			return nil
		}
		if attempt+1 >= q.cfg.MaxConflictRetries {
			return fmt.Errorf("%d hotplug changes still conflicting after %d attempts", len(retry), attempt+1)
		}
		// Spread concurrent writers apart before reading again.
		delay := time.Duration(10<<attempt)*time.Millisecond + time.Duration(rand.Int64N(int64(10*time.Millisecond)))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		pending = retry
	}
}

// record books the backend's outcomes: expectations for what was written,
// final answers for rejected volumes, and what to retry.
func (q *Queue) record(ctx context.Context, vm string, changes []Change, outs []Outcome) (retry []Change, failed error) {
	logger := klog.FromContext(ctx)
	q.mu.Lock()
	defer q.mu.Unlock()
	w := q.vmWork(vm)
	now := q.now()
	wrote := false
	for i, c := range changes {
		o := outs[i]
		it := w.intents[c.Volume]
		if it != nil && it.op != c.Op {
			it = nil // superseded while we wrote; the write still needs watching
		}
		q.metrics.results.WithLabelValues(o.Result.String()).Inc()
		switch o.Result {
		case Applied, AlreadyDone, InFlight:
			w.expect[c.Volume] = expectation{op: c.Op, since: now}
			wrote = wrote || o.Result == Applied
			if o.Result != Applied {
				logger.V(2).Info("hotplug change already under way", "volume", c.Volume, "op", c.Op, "result", o.Result, "detail", errString(o.Err))
			}
		case Conflict:
			retry = append(retry, c)
		case Rejected:
			logger.Info("hotplug change rejected", "volume", c.Volume, "op", c.Op, "err", o.Err)
			if it != nil {
				q.finishLocked(w, it, &RejectedError{Volume: c.Volume, VM: vm, Op: c.Op, Err: o.Err})
			}
		case VMGone:
			if it != nil && it.op == Attach {
				q.finishLocked(w, it, ErrVMNotFound)
			}
		case Failed:
			if failed == nil {
				failed = fmt.Errorf("%s of volume %s: %w", c.Op, c.Volume, o.Err)
			}
		}
	}
	if wrote {
		w.settlingSince = now
		q.metrics.writes.Inc()
	}
	q.dropIfIdleLocked(vm)
	return retry, failed
}

func fmtChanges(cs []Change) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.Op.String() + ":" + c.Volume
	}
	return out
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
