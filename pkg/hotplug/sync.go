package hotplug

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
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
	q.mu.Unlock()

	f := facts{o: obs}
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
	if idle && p.hold != "" {
		klog.FromContext(ctx).V(3).Info("holding changes", "reason", p.hold, "pending", len(p.changes))
	}
	if idle && len(releasing) == 0 {
		q.dropIfIdleLocked(key)
	}
	q.mu.Unlock()
	q.reportWedges(ctx, notices)
	q.releaseThenFinish(ctx, key, volumesOf(releasing), releasing, nil)
	if idle {
		return nil
	}
	return q.write(ctx, key, p.changes)
}

// applyPlanLocked books what decide returned, and returns the wedges that
// began or ended, to be reported outside the lock.
func (q *Queue) applyPlanLocked(ctx context.Context, key cache.ObjectName, w *vmWork, p plan, now time.Time) []WedgeNotice {
	logger := klog.FromContext(ctx)
	for _, vol := range p.expired {
		delete(w.expect, vol)
	}
	w.settlingSince, w.progress = p.settlingSince, p.progress
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

// write makes the changes, retrying conflicts at once after a fresh read (the
// backend reads anew on every call) a bounded number of times. Before an
// exclusive attach goes out, who holds its volume is read from the API
// server itself, and the volume is reserved for the VM on its host PVC: an
// informer that lags, or a write of another process (a controller that has
// not noticed it lost its lease, a second replica during a rolling update),
// must never let one volume be attached to two VMs.
func (q *Queue) write(ctx context.Context, key cache.ObjectName, changes []Change) error {
	logger := klog.FromContext(ctx)
	var live map[string][]string
	excl := q.exclusiveAdds(key, changes)
	if len(excl) > 0 {
		h, err := q.liveHolders(ctx, excl)
		if err != nil {
			return q.noteFailure(ctx, key, fmt.Errorf("read who holds %v: %w", excl, err))
		}
		live = h
	}
	claims, err := q.readClaims(ctx, changes)
	if err != nil {
		return q.noteFailure(ctx, key, err)
	}
	pending := changes
	for attempt := 0; ; attempt++ {
		reserved, err := q.reserveAndReread(ctx, key, excl, pending, claims, live)
		if err != nil {
			return q.noteFailure(ctx, key, err)
		}
		// now bounds this attempt: every exclusive attach in it was
		// checked fresh at now, and the backend call ends RequestTimeout
		// after it, so no write outlives its reservation's TTL.
		now := q.now()
		q.mu.Lock()
		var unwritten []string
		pending, unwritten = q.confirmLocked(ctx, key, pending, live, claims, reserved, now)
		until := q.untilLocked(key, pending)
		q.mu.Unlock()
		if len(pending) == 0 {
			q.unreserve(ctx, key, unwritten, claims)
			return nil
		}
		q.metrics.batchSize.Observe(float64(len(pending)))
		logger.V(2).Info("applying hotplug changes", "backend", q.backend.Name(), "changes", fmtChanges(pending), "attempt", attempt)
		start := q.now()
		actx, cancel := q.attemptContext(ctx, now, until)
		outs := q.backend.Apply(actx, key.Name, pending)
		cancel()
		q.metrics.applyDuration.Observe(q.now().Sub(start).Seconds())
		if len(outs) != len(pending) {
			return fmt.Errorf("backend %s answered %d outcomes for %d changes", q.backend.Name(), len(outs), len(pending))
		}
		retry, turnedDown, answers, failed := q.record(ctx, key, pending, outs)
		// Releases wait until the call is made: they must not eat into
		// its deadline, which runs from now.
		q.releaseThenFinish(ctx, key, append(turnedDown, unwritten...), answers, claims)
		if failed != nil {
			return q.noteFailure(ctx, key, failed)
		}
		if len(retry) == 0 {
			q.wq.AddAfter(key, q.cfg.MaxHold) // in case no informer event ever shows the result
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

// reserveAndReread reserves the volumes of the exclusive attaches among
// pending (see reserve), and reads again from the API server who holds
// those whose reservation was taken over from another VM, into live.
func (q *Queue) reserveAndReread(ctx context.Context, key cache.ObjectName, excl []string, pending []Change, claims map[string]HostClaim, live map[string][]string) (map[string]reservation, error) {
	var vols []string
	for _, c := range pending {
		if c.Op == Attach && slices.Contains(excl, c.Volume) {
			vols = append(vols, c.Volume)
		}
	}
	if len(vols) == 0 {
		return nil, nil
	}
	reserved, reread, err := q.reserve(ctx, key, vols, claims, live)
	if err != nil {
		return nil, err
	}
	if len(reread) > 0 {
		h, err := q.liveHolders(ctx, reread)
		if err != nil {
			q.unreserve(ctx, key, reread, claims)
			return nil, fmt.Errorf("read who holds %v: %w", reread, err)
		}
		for _, vol := range reread {
			live[vol] = h[vol]
		}
	}
	return reserved, nil
}

// exclusiveAdds lists the volumes of changes that exclusive attach intents
// of the VM are about to add.
func (q *Queue) exclusiveAdds(key cache.ObjectName, changes []Change) []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	w := q.work[key]
	if w == nil {
		return nil
	}
	var vols []string
	for _, c := range changes {
		if it := w.intents[c.Volume]; c.Op == Attach && it != nil && it.op == Attach && it.exclusive {
			vols = append(vols, c.Volume)
		}
	}
	return vols
}

// readClaims reads, from the API server, the host PVC (and its
// reservation) of every volume changes add.
func (q *Queue) readClaims(ctx context.Context, changes []Change) (map[string]HostClaim, error) {
	ctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
	defer cancel()
	out := map[string]HostClaim{}
	for _, c := range changes {
		if c.Op != Attach {
			continue
		}
		cl, err := q.reader.Claim(ctx, c.Volume)
		if err != nil {
			return nil, fmt.Errorf("read host PVC %s: %w", c.Volume, err)
		}
		out[c.Volume] = cl
	}
	return out, nil
}

// liveHolders reads from the API server which VMs hold each volume: in the
// VM spec, a queued legacy request, the VMI spec or its volume status.
// Workers asking at the same time share one read (liveReads).
func (q *Queue) liveHolders(ctx context.Context, vols []string) (map[string][]string, error) {
	r, err := q.live.get(ctx)
	if err != nil {
		return nil, err
	}
	vms, vmis := r.vms, r.vmis
	want := map[string]bool{}
	for _, v := range vols {
		want[v] = true
	}
	out := map[string][]string{}
	add := func(claims []string, vm string) {
		for _, c := range claims {
			if want[c] && !slices.Contains(out[c], vm) {
				out[c] = append(out[c], vm)
			}
		}
	}
	for i := range vms {
		add(vmClaims(&vms[i]), vms[i].Name)
	}
	for i := range vmis {
		add(vmiClaims(&vmis[i]), vmis[i].Name)
	}
	return out, nil
}

// confirmLocked runs right before each attempt: it drops changes whose
// intent was answered or superseded since it was planned, refuses attaches
// of claims that are gone or not Bound (they would stall every new volume
// of the VM in KubeVirt), refuses exclusive
// attaches whose volume another VM holds now (informers, this process's
// unobserved writes and pending intents, the live read and the volume's
// reservation), holds back those that must wait for another controller's
// reservation or whose own reservation is no longer fresh at now, and
// registers the rest as expected before they are written, so that no caller
// can be told "detached" and no other VM can take the volume while the write
// is on its way. unwritten lists the attaches not written whose reservation
// may be this process's, to be released.
func (q *Queue) confirmLocked(ctx context.Context, key cache.ObjectName, changes []Change, live map[string][]string, claims map[string]HostClaim, reserved map[string]reservation, now time.Time) (out []Change, unwritten []string) {
	logger := klog.FromContext(ctx)
	w := q.vmWork(key)
	out = changes[:0:0]
	var wakeAt time.Time
	for _, c := range changes {
		it := w.intents[c.Volume]
		if it == nil || it.op != c.Op {
			delete(w.expect, c.Volume)
			if c.Op == Attach {
				unwritten = append(unwritten, c.Volume)
			}
			continue
		}
		if !it.until.IsZero() && !now.Before(it.until) {
			logger.Info("detach dropped before writing it: its caller's deadline passed", "volume", c.Volume, "deadline", it.until)
			delete(w.expect, c.Volume)
			q.finishLocked(w, it, &ExpiredError{Volume: c.Volume, VM: key.Name, Deadline: it.until})
			continue
		}
		if cl, ok := claims[c.Volume]; c.Op == Attach && ok && (!cl.Exists || cl.Phase != corev1.ClaimBound) {
			err := &ClaimNotReadyError{Volume: c.Volume, VM: key.Name}
			if cl.Exists {
				err.Phase = cl.Phase
			}
			logger.Info("attach refused right before writing it", "volume", c.Volume, "err", err)
			delete(w.expect, c.Volume)
			q.finishLocked(w, it, err)
			continue
		}
		if c.Op == Attach && it.exclusive {
			err := q.heldElsewhereLocked(key, c.Volume)
			if err == nil {
				for _, other := range live[c.Volume] {
					if other != key.Name {
						err = &HeldError{Volume: c.Volume, VM: other, State: "attached or attaching (read from the API server)"}
						break
					}
				}
			}
			if err == nil {
				err = reserved[c.Volume].held
			}
			if err != nil {
				logger.Info("exclusive attach refused right before writing it", "volume", c.Volume, "err", err)
				delete(w.expect, c.Volume)
				q.finishLocked(w, it, err)
				unwritten = append(unwritten, c.Volume)
				continue
			}
			if r, ok := reserved[c.Volume]; ok && r.verdict.action == reserveWait {
				if wakeAt.IsZero() || r.verdict.until.Before(wakeAt) {
					wakeAt = r.verdict.until
				}
				continue
			}
			if !q.ownFresh(claims[c.Volume], key.Name, now) {
				// Not reserved in this attempt (the intent became
				// exclusive meanwhile) or the reservation aged while
				// it was taken: the next pass reserves it again.
				logger.V(2).Info("volume not freshly reserved for this VM, looking again", "volume", c.Volume)
				q.wq.Add(key)
				continue
			}
		}
		w.expect[c.Volume] = expectation{op: c.Op, since: now}
		out = append(out, c)
	}
	if !wakeAt.IsZero() {
		q.wq.AddAfter(key, wakeAt.Sub(now))
	}
	q.dropIfIdleLocked(key)
	return out, unwritten
}

// attemptContext bounds one attempt by the request timeout counted from now
// (when its reservations were checked fresh) and by until, the earliest
// DetachBefore deadline of its changes: no request of the attempt leaves
// this process after either.
func (q *Queue) attemptContext(ctx context.Context, now, until time.Time) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithDeadline(ctx, now.Add(q.cfg.RequestTimeout))
	if until.IsZero() {
		return ctx, cancel
	}
	ctx, cancelUntil := context.WithDeadline(ctx, until)
	return ctx, func() { cancelUntil(); cancel() }
}

// untilLocked is the earliest deadline of the intents behind changes (zero:
// none has one).
func (q *Queue) untilLocked(key cache.ObjectName, changes []Change) time.Time {
	var until time.Time
	w := q.work[key]
	if w == nil {
		return until
	}
	for _, c := range changes {
		if it := w.intents[c.Volume]; it != nil && !it.until.IsZero() && (until.IsZero() || it.until.Before(until)) {
			until = it.until
		}
	}
	return until
}

// record books the backend's outcomes: expectations for what was (or may
// have been) written, final answers for rejected volumes, and what to retry.
// turnedDown lists the attaches the host refused without writing anything,
// whose reservation is to be released before answers go to their callers.
func (q *Queue) record(ctx context.Context, key cache.ObjectName, changes []Change, outs []Outcome) (retry []Change, turnedDown []string, answers []resolution, failed error) {
	logger := klog.FromContext(ctx)
	q.mu.Lock()
	defer q.mu.Unlock()
	w := q.vmWork(key)
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
			if it != nil {
				it.written = now
			}
			wrote = wrote || o.Result == Applied
			if o.Result != Applied {
				logger.V(2).Info("hotplug change already under way", "volume", c.Volume, "op", c.Op, "result", o.Result, "detail", errString(o.Err))
			}
		case Conflict:
			delete(w.expect, c.Volume)
			retry = append(retry, c)
		case Rejected:
			delete(w.expect, c.Volume)
			logger.Info("hotplug change rejected", "volume", c.Volume, "op", c.Op, "err", o.Err)
			err := &RejectedError{Volume: c.Volume, VM: key.Name, Op: c.Op, Err: o.Err}
			switch {
			case c.Op == Attach:
				turnedDown = append(turnedDown, c.Volume)
				if it != nil {
					answers = append(answers, resolution{it: it, err: err})
				}
			case it != nil:
				q.finishLocked(w, it, err)
			}
		case VMGone:
			delete(w.expect, c.Volume)
			if c.Op == Attach {
				turnedDown = append(turnedDown, c.Volume)
				if it != nil {
					answers = append(answers, resolution{it: it, err: &VMNotFoundError{VM: key.Name, Volume: c.Volume, Namespace: key.Namespace}})
				}
			}
		case Failed:
			if refused(o.Err) {
				// The host answered and did nothing.
				delete(w.expect, c.Volume)
			} // else the write may have landed: keep expecting it
			if failed == nil {
				failed = fmt.Errorf("%s of volume %s: %w", c.Op, c.Volume, o.Err)
			}
		}
	}
	if wrote {
		w.settlingSince = now
		q.metrics.writes.Inc()
	}
	if failed == nil {
		w.lastErr, w.failingSince = nil, time.Time{}
	}
	q.dropIfIdleLocked(key)
	return retry, turnedDown, answers, failed
}

// noteFailure remembers a failed attempt at the host as the VM's last error,
// wakes the VM's waiting callers when retrying cannot help, and returns err
// for the worker's backoff.
func (q *Queue) noteFailure(ctx context.Context, key cache.ObjectName, err error) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	w := q.work[key]
	if w == nil {
		return err
	}
	q.metrics.hostFailures.WithLabelValues(failureCause(err)).Inc()
	if w.lastErr == nil {
		w.failingSince = q.now()
	}
	w.lastErr = err
	if permanent(err) {
		close(w.failed)
		w.failed = make(chan struct{})
	}
	klog.FromContext(ctx).Info("attempt at the host failed", "err", err, "failingSince", w.failingSince, "pending", len(w.intents))
	return err
}

const (
	causeRefused     = "refused"
	causeUnavailable = "unavailable"
	causeOther       = "other"
)

// failureCause sorts a failed attempt for the host failures metric.
func failureCause(err error) string {
	switch {
	case permanent(err):
		return causeRefused
	case errors.Is(err, context.DeadlineExceeded), apierrors.IsServiceUnavailable(err), apierrors.IsTimeout(err),
		apierrors.IsServerTimeout(err), apierrors.IsTooManyRequests(err), !refused(err) && !isAPIStatus(err):
		return causeUnavailable
	}
	return causeOther
}

func isAPIStatus(err error) bool {
	var status apierrors.APIStatus
	return errors.As(err, &status)
}

// permanent reports an error retrying cannot cure until an operator acts:
// the host refuses the driver's identity.
func permanent(err error) bool {
	return apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err)
}

// refused reports an answer from the API server that says the request was
// not carried out; anything else (a timeout, a dropped connection, a 5xx)
// may have been. A validating webhook the API server could not call is a 500
// that stored nothing: admission runs before the write, and with
// failurePolicy Fail the call's failure rejects the request (kubernetes
// v1.33 staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/validating/dispatcher.go,
// "failed calling webhook" from pkg/util/webhook/error.go).
func refused(err error) bool {
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return false
	}
	code := status.Status().Code
	return code >= 400 && code < 500 || strings.Contains(status.Status().Message, "failed calling webhook")
}

func hasAttach(w *vmWork) bool {
	for _, it := range w.intents {
		if it.op == Attach {
			return true
		}
	}
	return false
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
