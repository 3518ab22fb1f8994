package driver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// answer is how a publish or unpublish that did not finish is answered: the
// gRPC code for the external-attacher and the Event on the guest
// VolumeAttachment (no reason: no Event).
type answer struct {
	code      codes.Code
	eventType string
	reason    string
}

// answerRow matches one kind of error of the hotplug queue (the errors
// listed at hotplug.ErrNotReady) or of the detach guard.
type answerRow struct {
	match func(error) bool
	answer
}

// answers is the one table of those answers; the first matching row wins.
// Only NotFound, FailedPrecondition and a host rejection are final; whatever
// is still in flight gets a code the external-attacher treats as "may still
// happen". A function, not a variable: the table is never changed.
func answers() []answerRow {
	return []answerRow{
		{claimGone, event(codes.NotFound, corev1.EventTypeWarning, "HostClaimNotReady")},
		{isA[*hotplug.ClaimNotReadyError], event(codes.Aborted, corev1.EventTypeWarning, "HostClaimNotReady")},
		// This process stopping cut the host call off: no Event.
		{stalledCanceled, answer{code: codes.Unavailable}},
		// Still pending, but the host refused or did not answer: say why,
		// with the code of the cause.
		{stalledRefused, event(codes.PermissionDenied, corev1.EventTypeWarning, "HostRefusedOrUnreachable")},
		{isA[*hotplug.StalledError], event(codes.Unavailable, corev1.EventTypeWarning, "HostRefusedOrUnreachable")},
		{is(hotplug.ErrNotReady), event(codes.Unavailable, corev1.EventTypeWarning, "HotplugFailed")},
		{is(hotplug.ErrVMNotFound), event(codes.NotFound, corev1.EventTypeWarning, "HotplugFailed")},
		{isA[*hotplug.HeldError], event(codes.FailedPrecondition, corev1.EventTypeWarning, "VolumeHeldByAnotherVM")},
		// A newer request replaced this one: nothing to explain.
		{isA[*hotplug.SupersededError], answer{code: codes.Aborted}},
		// The CSI spec's answer for a node that cannot take another volume;
		// the external-attacher retries it, so the attach goes ahead once a
		// disk leaves the VM. Before RejectedError: KubeVirt's own refusal
		// of a VM over the limit comes wrapped in one.
		{is(hotplug.ErrVMFull), event(codes.ResourceExhausted, corev1.EventTypeWarning, "DiskLimitReached")},
		{isA[*hotplug.RejectedError], event(codes.FailedPrecondition, corev1.EventTypeWarning, "HotplugRejected")},
		{is(hotplug.ErrStopped), event(codes.Unavailable, corev1.EventTypeWarning, "HotplugFailed")},
		// Aborted, not Unavailable: the external-attacher retries both with
		// backoff, and Aborted is CSI's "an operation on this volume is
		// still pending" (the guest's unmount), where Unavailable would say
		// the driver itself is down.
		{isA[*guest.InUseError], event(codes.Aborted, corev1.EventTypeNormal, "VolumeStillInUse")},
		{isA[*guestUseUnknownError], event(codes.Unavailable, corev1.EventTypeWarning, "HotplugFailed")},
		// Wedged in KubeVirt: as unfinished as any wait (the attacher
		// retries), only the message says more. No Event here: the queue
		// reports each wedge once (wedgeEvents), not on every retry.
		{wedgedInProgress, answer{code: codes.DeadlineExceeded}},
		{is(context.DeadlineExceeded), event(codes.DeadlineExceeded, corev1.EventTypeNormal, "HotplugWaiting")},
		// The caller went away: nobody reads the answer.
		{is(context.Canceled), answer{code: codes.Canceled}},
	}
}

// answerFor looks err up in the table; anything else is Internal.
func answerFor(err error) answer {
	for _, r := range answers() {
		if r.match(err) {
			return r.answer
		}
	}
	return event(codes.Internal, corev1.EventTypeWarning, "HotplugFailed")
}

// event is an answer with an Event of that type and reason.
func event(code codes.Code, eventType, reason string) answer {
	return answer{code: code, eventType: eventType, reason: reason}
}

func is(target error) func(error) bool { return func(err error) bool { return errors.Is(err, target) } }

func isA[T error](err error) bool {
	var t T
	return errors.As(err, &t)
}

func claimGone(err error) bool {
	var claim *hotplug.ClaimNotReadyError
	return errors.As(err, &claim) && claim.Phase == ""
}

func wedgedInProgress(err error) bool {
	return isA[*hotplug.WedgedError](err) && errors.Is(err, context.DeadlineExceeded)
}

func stalledCanceled(err error) bool {
	return isA[*hotplug.StalledError](err) && errors.Is(err, context.Canceled)
}

func stalledRefused(err error) bool {
	return isA[*hotplug.StalledError](err) && (apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err))
}

// guestUseUnknownError says the detach guard could not tell whether the
// guest still uses the volume (its caches not synced, the guest API down).
type guestUseUnknownError struct {
	volume, vm string
	err        error
}

func (e *guestUseUnknownError) Error() string {
	return fmt.Sprintf("volume %s on VM %s: cannot tell whether the guest still uses it: %v", e.volume, e.vm, e.err)
}

func (e *guestUseUnknownError) Unwrap() error { return e.err }

// hotplugStatus is the CSI answer to an error of a publish or unpublish.
func hotplugStatus(err error) error {
	return status.Error(answerFor(err).code, err.Error())
}

// failAttachment answers a publish or unpublish that did not finish, and
// records on the guest VolumeAttachment why: the attacher shows only the
// last error, and an operator looking at a pod stuck in ContainerCreating
// should see what the volume waits for, which VM holds it, or what the host
// refused.
func (s *controllerService) failAttachment(ctx context.Context, vol, vm string, err error) error {
	a := answerFor(err)
	if s.opts.Events != nil && a.reason != "" {
		// Use a fresh context: the call's own may be over, and the Event
		// explains its answer.
		ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), hostCallTimeout)
		defer cancel()
		s.opts.Events.Record(ectx, vol, vm, a.eventType, a.reason, err.Error())
	}
	return status.Error(a.code, err.Error())
}

func apiStatus(err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...) + ": " + err.Error()
	switch {
	case apierrors.IsNotFound(err):
		return status.Error(codes.NotFound, msg)
	case apierrors.IsAlreadyExists(err):
		return status.Error(codes.AlreadyExists, msg)
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		return status.Error(codes.PermissionDenied, msg)
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err):
		return status.Error(codes.InvalidArgument, msg)
	case apierrors.IsTimeout(err), apierrors.IsServerTimeout(err), apierrors.IsTooManyRequests(err), apierrors.IsServiceUnavailable(err),
		apierrors.IsInternalError(err), errors.Is(err, context.DeadlineExceeded), isConnectionError(err):
		// The host did not answer, or not usefully: retrying may help.
		return status.Error(codes.Unavailable, msg)
	}
	return status.Error(codes.Internal, msg)
}

// inUseOnHost reports Harvester's PVC validator refusing to delete a claim
// that a VM template names (harvester v1.7.0
// pkg/webhook/resources/persistentvolumeclaim/validator.go:100-110, 422;
// v1.8.0 :107-108, 409).
func inUseOnHost(err error) bool {
	return (apierrors.IsInvalid(err) || apierrors.IsConflict(err)) && strings.Contains(err.Error(), "which is currently attached to VM")
}

// isConnectionError reports a host API that could not be reached at all.
func isConnectionError(err error) bool {
	var netErr net.Error
	var opErr *net.OpError
	return errors.As(err, &netErr) || errors.As(err, &opErr)
}
