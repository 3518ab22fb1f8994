package hotplug

// Right before each attempt: what may still be written, and the deadline
// its requests carry.

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

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
// may be this process's, to be released. A withdrawal (withdraws) is a
// removal of an add whose attach intent stays: it is written while that
// intent is still an attach.
func (q *Queue) confirmLocked(ctx context.Context, key cache.ObjectName, changes []Change, live map[string][]string, claims map[string]HostClaim, reserved map[string]reservation, now time.Time, withdraws bool) (out []Change, unwritten []string) {
	logger := klog.FromContext(ctx)
	w := q.vmWork(key)
	out = changes[:0:0]
	var wakeAt time.Time
	for _, c := range changes {
		it := w.intents[c.Volume]
		if withdraws {
			if it == nil || it.op != Attach || c.Op != Detach {
				continue // answered or superseded meanwhile
			}
			w.expect[c.Volume] = expectation{op: c.Op, since: now}
			out = append(out, c)
			continue
		}
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
