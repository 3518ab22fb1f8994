package testwait

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// recorder stands in for *testing.T so the test can see a failure without
// failing itself.
type recorder struct {
	testing.TB
	failed atomic.Bool
	msg    string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failed.Store(true)
	r.msg = format
	// Fatalf must stop the caller, as testing.T's does.
	panic(r)
}

func run(r *recorder, f func()) {
	defer func() {
		if p := recover(); p != nil && p != r {
			panic(p)
		}
	}()
	f()
}

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	r := &recorder{TB: t}
	run(r, func() {
		For(r, "third call", 10*time.Second, func() bool { return calls.Add(1) >= 3 })
	})
	if r.failed.Load() || calls.Load() != 3 {
		t.Errorf("failed=%v calls=%d, want a pass on the third call", r.failed.Load(), calls.Load())
	}
}

func TestUntilFailsWithTheLastStateWhenTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	r := &recorder{TB: t}
	run(r, func() {
		Until(ctx, r, "never", func() (bool, string) { return false, "still false" })
	})
	if !r.failed.Load() {
		t.Fatal("Until returned for a condition that never held")
	}
}

func TestPollStopsAtTheConditionsError(t *testing.T) {
	gone := errors.New("the process exited")
	calls := 0
	err := Poll(context.Background(), "a process that exited", func() (bool, string, error) {
		calls++
		if calls == 2 {
			return false, "", gone
		}
		return false, "starting", nil
	})
	if !errors.Is(err, gone) || calls != 2 {
		t.Fatalf("Poll = %v after %d calls, want the condition's error at the second", err, calls)
	}
}

func TestPollNamesTheLastStateWhenTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := PollEvery(ctx, time.Millisecond, "readiness", func() (bool, string, error) { return false, "503", nil })
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "readiness: 503") {
		t.Fatalf("Poll = %v, want the context's error naming what and the last state", err)
	}
}
