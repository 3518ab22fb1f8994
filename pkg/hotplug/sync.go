package hotplug

// The worker's pass over one VM: observe it, let the planner decide, book
// its answers and waits, then hand the changes to write (write.go).

import (
	"context"
	"fmt"
	"time"

	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// sync is one worker pass over a VM: answer what is known, then write what
// is pending unless the VM must be left to settle.
func (q *Queue) sync(ctx context.Context, key cache.ObjectName) error {
	q.releaseAsked(ctx, key)
	obs := q.observe(key)
	q.mu.Lock()
	w := q.work[key]
	if w == nil {
		q.mu.Unlock()
		return nil
	}
	askLive := obs.vm == nil && hasAttach(w)
	intents := len(w.intents) > 0
	q.mu.Unlock()

	f := facts{o: obs}
	if intents {
		f.migrating = q.migrationUnderWay(ctx, key, obs)
	}
	if askLive {
		// The informer may not show a VM created a moment ago: only the API
		// server may say it does not exist.
		rctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
		exists, err := q.reader.VMExists(rctx, key.Name)
		cancel()
		if err != nil {
			return q.noteFailure(ctx, key, fmt.Errorf("look up VM %s: %w", key.Name, err))
		}
		f.vmGone = !exists
	}

	q.mu.Lock()
	w = q.work[key]
	if w == nil {
		q.mu.Unlock()
		return nil
	}
	f.held = q.heldLocked(key, w)
	f.refused = q.refusalsLocked(obs, w)
	now := q.now()
	p := decide(now, q.cfg, w, f)
	releasing := releasesFirst(&p)
	notices := q.applyPlanLocked(ctx, key, w, p, now)
	idle := len(p.changes) == 0 || p.hold != ""
	if l := klog.FromContext(ctx).V(3); idle && p.hold != "" && l.Enabled() {
		l.Info("holding changes", "reason", p.hold, "pending", len(p.changes), "behind", f.o.inFlight(w.expect))
	}
	if !idle && p.joins {
		klog.FromContext(ctx).V(2).Info("adds join the attachment pod KubeVirt is starting", "changes", fmtChanges(p.changes), "cycleStarted", w.cycleStart)
	}
	if idle && len(releasing) == 0 {
		q.dropIfIdleLocked(key)
	}
	q.mu.Unlock()
	q.reportWedges(ctx, notices)
	if p.wakeKubeVirt {
		q.wakeKubeVirt(ctx, key, len(obs.vm.Status.VolumeRequests), now.Sub(p.stalledSince))
	}
	q.releaseThenFinish(ctx, key, volumesOf(releasing), releasing, nil)
	if idle {
		return nil
	}
	if p.withdraws {
		klog.FromContext(ctx).Info("withdrawing adds from the VM while its live migration starts, to add them again after it", "changes", fmtChanges(p.changes))
	}
	return q.write(ctx, key, p.changes, p.joins, p.withdraws)
}

// applyPlanLocked books what decide returned, and returns the wedges that
// began or ended, to be reported outside the lock.
func (q *Queue) applyPlanLocked(ctx context.Context, key cache.ObjectName, w *vmWork, p plan, now time.Time) []WedgeNotice {
	logger := klog.FromContext(ctx)
	for _, vol := range p.expired {
		delete(w.expect, vol)
	}
	w.settlingSince, w.progress = p.settlingSince, p.progress
	w.stalledSince, w.stallMark = p.stalledSince, p.stallMark
	if p.wakeKubeVirt {
		w.wokeAt = now
	}
	w.hold = p.hold
	for _, r := range p.resolve {
		q.resolveLocked(ctx, w, r, now)
	}
	for _, vol := range p.cleanup {
		// Nobody waits on this detach; it keeps the queue at the volume
		// until nothing of the refused attach is left on the VM or VMI.
		logger.Info("undoing a refused attach", "volume", vol)
		w.intents[vol] = newIntent(key.Name, vol, Detach, now)
	}
	notices := q.noteWaitsLocked(ctx, key, w, p.waits, now)
	if !p.wakeAt.IsZero() {
		q.wq.AddAfter(key, p.wakeAt.Sub(now))
	}
	return notices
}

// resolveLocked answers a resolved intent's callers, unless they were
// answered already (superseded meanwhile).
func (q *Queue) resolveLocked(ctx context.Context, w *vmWork, r resolution, now time.Time) {
	select {
	case <-r.it.done:
		return
	default:
	}
	held, host := r.it.split(now)
	klog.FromContext(ctx).V(2).Info("intent done", "volume", r.it.volume, "op", r.it.op, "err", r.err, "after", now.Sub(r.it.created), "held", held, "host", host)
	q.finishLocked(w, r.it, r.err)
}

// noteWaitsLocked keeps, per volume, what its intent waits for and since
// when, and says in the log when a wait has lasted SlowAfter: a KubeVirt
// entry stuck in one phase must not go unnoticed. A wait on KubeVirt that
// shows no progress for WedgedAfter is a wedge (trackWedgeLocked); it
// returns the wedges that began or ended, for the caller to report once it
// has let go of the lock.
func (q *Queue) noteWaitsLocked(ctx context.Context, key cache.ObjectName, w *vmWork, waits map[string]waitFor, now time.Time) []WedgeNotice {
	var notices []WedgeNotice
	for vol, st := range w.waiting {
		if _, ok := waits[vol]; !ok {
			if n := endWedgeLocked(key, vol, st); n != nil {
				notices = append(notices, *n)
			}
			delete(w.waiting, vol)
		}
	}
	var next time.Time
	later := func(at time.Time) {
		if !at.IsZero() && (next.IsZero() || at.Before(next)) {
			next = at
		}
	}
	for vol, wf := range waits {
		st, ok := w.waiting[vol]
		if !ok || st.why != wf.why {
			st.why, st.since, st.logged = wf.why, now, false
		}
		op := Attach
		if it := w.intents[vol]; it != nil {
			op = it.op
		}
		if !st.logged {
			if now.Sub(st.since) >= q.cfg.SlowAfter {
				klog.FromContext(ctx).Info("hotplug request waiting long", "volume", vol, "op", op, "waitingFor", wf.why, "since", st.since, "for", now.Sub(st.since).Round(time.Second))
				st.logged = true
			} else {
				later(st.since.Add(q.cfg.SlowAfter))
			}
		}
		n, at := q.trackWedgeLocked(ctx, key, vol, op, &st, wf, now)
		if n != nil {
			notices = append(notices, *n)
		}
		later(at)
		w.waiting[vol] = st
	}
	if !next.IsZero() {
		q.wq.AddAfter(key, next.Sub(now))
	}
	return notices
}

// heldLocked says, for each exclusive attach intent of the VM, whether
// another VM holds the volume as far as the informers and this process know.
func (q *Queue) heldLocked(key cache.ObjectName, w *vmWork) map[string]error {
	held := map[string]error{}
	for vol, it := range w.intents {
		if it.op == Attach && it.exclusive {
			if err := q.heldElsewhereLocked(key, vol); err != nil {
				held[vol] = err
			}
		}
	}
	return held
}

// refusalsLocked reads, for each attach intent of the VM, whether the host
// refused the VM's queued add request for its volume.
func (q *Queue) refusalsLocked(obs observed, w *vmWork) map[string]error {
	refused := map[string]error{}
	for vol, it := range w.intents {
		if it.op != Attach {
			continue
		}
		if err := q.backend.Refusal(obs.vm, vol); err != nil {
			refused[vol] = err
		}
	}
	return refused
}

func hasAttach(w *vmWork) bool {
	for _, it := range w.intents {
		if it.op == Attach {
			return true
		}
	}
	return false
}

// wakeKubeVirt wakes KubeVirt's VM controller for the VM's queued requests
// (plan.stalledRequests). A failure is only logged: the requests still move
// at the controller's next retry, and the next stall wakes it again.
func (q *Queue) wakeKubeVirt(ctx context.Context, key cache.ObjectName, requests int, still time.Duration) {
	logger := klog.FromContext(ctx)
	logger.Info("KubeVirt's VM controller has not moved the VM's queued hotplug requests; waking it", "requests", requests, "still", still.Round(time.Second))
	rctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
	defer cancel()
	if err := q.reader.WakeVM(rctx, key.Name, q.now()); err != nil {
		logger.Info("waking KubeVirt's VM controller failed", "err", err)
	}
}
