// Package csiattacher is the tests' one model of how the external-attacher
// calls ControllerPublishVolume and ControllerUnpublishVolume, so the
// integration tests and the benchmarks drive the driver by the same rules.
//
// The rules are those of kubernetes-csi/external-attacher v4.12.0, the
// version the chart ships (tools/attacher/go.mod):
//
//   - Every failed call is retried, whatever its code. csiHandler.syncAttach
//     and syncDetach (pkg/controller/csi_handler.go:255-310) record the error
//     on the VolumeAttachment and SyncNewOrUpdatedVolumeAttachment
//     (csi_handler.go:234-253) requeues the item with AddRateLimited; csiAttach
//     drops the "final" flag Attach computes (csi_handler.go:526-528: the
//     controller will detach to be sure).
//   - The retry waits per item: --retry-interval-start (1 s) doubled on each
//     failure up to --retry-interval-max (5 min), a
//     workqueue.NewTypedItemExponentialFailureRateLimiter
//     (cmd/csi-attacher/main.go:69-70, 275-276); success resets it (Forget,
//     csi_handler.go:251). A waiting item holds no worker.
//   - --worker-threads (10, main.go:71) workers make the calls, each with its
//     own --timeout (15 s, main.go:68; csi_handler.go:523, 585).
//   - Which answers mean "the operation is over, not in progress" is
//     isFinalError (pkg/attacher/attacher.go:90-113): every code except
//     Canceled, DeadlineExceeded, Unavailable, ResourceExhausted and Aborted,
//     and never an error without a gRPC status. The attacher only reports
//     it; a test that wants to see the first such answer (what it would read
//     in the VolumeAttachment's status.attachError) asks DoUntil for it.
package csiattacher

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Config is the attacher's flags.
type Config struct {
	// Workers is --worker-threads; 0 lets every call run at once.
	Workers int
	// Timeout is --timeout, each call's own deadline.
	Timeout time.Duration
	// RetryStart and RetryMax are --retry-interval-start and
	// --retry-interval-max.
	RetryStart, RetryMax time.Duration
}

// Defaults are external-attacher v4.12.0's own defaults
// (cmd/csi-attacher/main.go).
func Defaults() Config {
	return Config{Workers: 10, Timeout: 15 * time.Second, RetryStart: time.Second, RetryMax: 5 * time.Minute}
}

// Scaled is c with its durations multiplied by s, for a simulator whose
// latencies are scaled by s.
func (c Config) Scaled(s float64) Config {
	f := func(d time.Duration) time.Duration { return time.Duration(float64(d) * s) }
	c.Timeout, c.RetryStart, c.RetryMax = f(c.Timeout), f(c.RetryStart), f(c.RetryMax)
	return c
}

// Backoff is how long an item waits after its failures-th failure in a row
// (1 for the first): RetryStart doubled per earlier failure, at most
// RetryMax, as the item rate limiter computes it.
func (c Config) Backoff(failures int) time.Duration {
	d := c.RetryStart
	for i := 1; i < failures && d < c.RetryMax; i++ {
		d *= 2
	}
	return min(d, c.RetryMax)
}

// Final reports whether the attacher takes err as the end of the operation
// rather than one that may still be in progress (isFinalError); nil, an OK
// answer, is final.
func Final(err error) bool {
	if err == nil {
		return true
	}
	st, ok := status.FromError(err)
	if !ok {
		return false
	}
	switch st.Code() {
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.ResourceExhausted, codes.Aborted:
		return false
	}
	return true
}

// Call is one ControllerPublish or ControllerUnpublish call.
type Call func(ctx context.Context, c csi.ControllerClient) error

// Attacher drives calls by Config's rules and counts every answer.
type Attacher struct {
	cfg   Config
	ctrl  func() csi.ControllerClient
	slots chan struct{} // nil: no worker limit

	mu      sync.Mutex
	answers map[codes.Code]int
	errs    []string
}

// New is an attacher calling the controller ctrl returns at each call (it
// may change when a test restarts the controller).
func New(cfg Config, ctrl func() csi.ControllerClient) *Attacher {
	a := &Attacher{cfg: cfg, ctrl: ctrl, answers: map[codes.Code]int{}}
	if cfg.Workers > 0 {
		a.slots = make(chan struct{}, cfg.Workers)
	}
	return a
}

// Do makes call until it answers OK, as the attacher does for one
// VolumeAttachment, and fails only when ctx ends, with the last answer.
func (a *Attacher) Do(ctx context.Context, call Call) error {
	return a.DoUntil(ctx, call, func(err error) bool { return err == nil })
}

// DoUntil is Do that returns the first answer stop accepts (stop sees nil
// for OK). The attacher itself would go on retrying: stop is what a test
// reads from the VolumeAttachment, e.g. Final.
func (a *Attacher) DoUntil(ctx context.Context, call Call, stop func(error) bool) error {
	for failures := 1; ; failures++ {
		err, ok := a.once(ctx, call)
		if !ok {
			return fmt.Errorf("no worker free before the end: %w", ctx.Err())
		}
		if stop(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("gave up after %w: %w", err, ctx.Err())
		case <-time.After(a.cfg.Backoff(failures)):
		}
	}
}

// once makes one call on a free worker; false when ctx ended before one was
// free.
func (a *Attacher) once(ctx context.Context, call Call) (error, bool) {
	if a.slots != nil {
		select {
		case a.slots <- struct{}{}:
			defer func() { <-a.slots }()
		case <-ctx.Done():
			return nil, false
		}
	}
	cctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	err := call(cctx, a.ctrl())
	cancel()
	a.mu.Lock()
	a.answers[status.Code(err)]++
	if err != nil {
		a.errs = append(a.errs, err.Error())
	}
	a.mu.Unlock()
	return err, true
}

// Publish publishes vol to vm until OK.
func (a *Attacher) Publish(ctx context.Context, req *csi.ControllerPublishVolumeRequest) error {
	return a.Do(ctx, PublishCall(req))
}

// Unpublish unpublishes vol from vm until OK.
func (a *Attacher) Unpublish(ctx context.Context, vm, vol string) error {
	return a.Do(ctx, UnpublishCall(vm, vol))
}

// PublishCall is the attacher's ControllerPublishVolume for req.
func PublishCall(req *csi.ControllerPublishVolumeRequest) Call {
	return func(ctx context.Context, c csi.ControllerClient) error {
		_, err := c.ControllerPublishVolume(ctx, req)
		return err
	}
}

// UnpublishCall is the attacher's ControllerUnpublishVolume of vol from vm.
func UnpublishCall(vm, vol string) Call {
	return func(ctx context.Context, c csi.ControllerClient) error {
		_, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: vm})
		return err
	}
}

// Answers counts the answers so far by code, OK included.
func (a *Attacher) Answers() map[codes.Code]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.answers)
}

// Errors are the messages of every failed call so far.
func (a *Attacher) Errors() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.errs)
}
