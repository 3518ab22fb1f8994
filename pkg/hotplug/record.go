package hotplug

// After each attempt: booking the backend's outcomes, a failed attempt, and
// how a failure is sorted (refused, unavailable, retried).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// record books the backend's outcomes: expectations for what was (or may
// have been) written, final answers for rejected volumes, and what to retry.
// turnedDown lists the attaches the host refused without writing anything,
// whose reservation is to be released before answers go to their callers.
func (q *Queue) record(ctx context.Context, key cache.ObjectName, changes []Change, outs []Outcome, joins bool) (retry []Change, turnedDown []string, answers []resolution, failed error) {
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
		if joins {
			w.joined = true
		} else {
			w.cycleStart, w.joined = now, false
		}
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

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
