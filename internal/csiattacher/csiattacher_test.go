package csiattacher

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// scripted answers ControllerPublishVolume with its codes in turn, then OK.
type scripted struct {
	csi.ControllerClient
	mu    sync.Mutex
	codes []codes.Code
	calls int
}

func (s *scripted) ControllerPublishVolume(context.Context, *csi.ControllerPublishVolumeRequest, ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if len(s.codes) == 0 {
		return &csi.ControllerPublishVolumeResponse{}, nil
	}
	c := s.codes[0]
	s.codes = s.codes[1:]
	return nil, status.Error(c, c.String())
}

// fast keeps the retries short; their length is not what is tested.
var fast = Config{Timeout: time.Second, RetryStart: time.Millisecond, RetryMax: 4 * time.Millisecond}

// TestDoRetriesEveryCode: the attacher retries final answers too, until OK.
func TestDoRetriesEveryCode(t *testing.T) {
	s := &scripted{codes: []codes.Code{codes.FailedPrecondition, codes.Internal, codes.NotFound, codes.Aborted, codes.Unavailable}}
	a := New(fast, func() csi.ControllerClient { return s })
	if err := a.Publish(context.Background(), &csi.ControllerPublishVolumeRequest{}); err != nil {
		t.Fatalf("Publish = %v, want OK after the retries", err)
	}
	if s.calls != 6 {
		t.Errorf("%d calls, want 6 (five failures, then OK)", s.calls)
	}
	if got := a.Answers(); got[codes.OK] != 1 || got[codes.FailedPrecondition] != 1 || len(a.Errors()) != 5 {
		t.Errorf("answers %v, errors %q", got, a.Errors())
	}
}

// TestDoUntilFinalStopsAtUpstreamsFinalCodes: transient answers are retried,
// the first final one is returned.
func TestDoUntilFinalStopsAtUpstreamsFinalCodes(t *testing.T) {
	for _, final := range []codes.Code{codes.Internal, codes.Unknown, codes.FailedPrecondition, codes.NotFound, codes.InvalidArgument} {
		s := &scripted{codes: []codes.Code{codes.Aborted, codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Canceled, final}}
		a := New(fast, func() csi.ControllerClient { return s })
		err := a.DoUntil(context.Background(), PublishCall(&csi.ControllerPublishVolumeRequest{}), Final)
		if status.Code(err) != final || s.calls != 6 {
			t.Errorf("DoUntil(Final) = %v after %d calls, want %s after 6", err, s.calls, final)
		}
	}
}

func TestBackoffDoublesUpToTheMax(t *testing.T) {
	c := Defaults()
	for failures, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 9: 256 * time.Second, 10: 5 * time.Minute, 40: 5 * time.Minute} {
		if got := c.Backoff(failures); got != want {
			t.Errorf("Backoff(%d) = %v, want %v", failures, got, want)
		}
	}
}

// blocking holds every call until released and counts those in flight.
type blocking struct {
	csi.ControllerClient
	release  chan struct{}
	inFlight atomic.Int32
	most     atomic.Int32
}

func (b *blocking) ControllerPublishVolume(ctx context.Context, _ *csi.ControllerPublishVolumeRequest, _ ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	n := b.inFlight.Add(1)
	defer b.inFlight.Add(-1)
	for m := b.most.Load(); n > m && !b.most.CompareAndSwap(m, n); m = b.most.Load() {
	}
	select {
	case <-b.release:
		return &csi.ControllerPublishVolumeResponse{}, nil
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// TestWorkersBoundTheCallsInFlight: no more calls at once than workers.
func TestWorkersBoundTheCallsInFlight(t *testing.T) {
	b := &blocking{release: make(chan struct{})}
	cfg := fast
	cfg.Workers, cfg.Timeout = 2, time.Minute
	a := New(cfg, func() csi.ControllerClient { return b })
	var wg sync.WaitGroup
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := a.Publish(context.Background(), &csi.ControllerPublishVolumeRequest{}); err != nil {
				t.Error(err)
			}
		}()
	}
	testwait.For(t, "two calls in flight", 30*time.Second, func() bool { return b.inFlight.Load() == 2 })
	close(b.release)
	wg.Wait()
	if m := b.most.Load(); m != 2 {
		t.Errorf("%d calls in flight at most, want 2", m)
	}
}
