// Package testwait is the one poll loop the tests share: they wait for state
// that other goroutines, processes or API servers change, never for a fixed
// time, because the CI machine is shared and its timing is not ours.
package testwait

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// interval is short enough that a test does not idle once the state is there,
// long enough not to compete with the code under test for the CPU.
const interval = 20 * time.Millisecond

// Until calls cond until it holds and fails tb when ctx ends first, naming
// what it waited for and the last state cond described.
func Until(ctx context.Context, tb testing.TB, what string, cond func() (bool, string)) {
	tb.Helper()
	UntilEvery(ctx, tb, interval, what, cond)
}

// UntilEvery is Until looking every `every` instead of the shared interval,
// for a state that lasts only a moment (a test that must act while a write is
// in flight).
func UntilEvery(ctx context.Context, tb testing.TB, every time.Duration, what string, cond func() (bool, string)) {
	tb.Helper()
	if err := PollEvery(ctx, every, what, func() (bool, string, error) {
		ok, state := cond()
		return ok, state, nil
	}); err != nil {
		tb.Fatalf("%v", err)
	}
}

// For is Until with its own bound and a condition without a state to report.
func For(tb testing.TB, what string, within time.Duration, cond func() bool) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	Until(ctx, tb, what, Bool(cond))
}

// Bool adapts a condition without a state to report to Until.
func Bool(cond func() bool) func() (bool, string) {
	return func() (bool, string) { return cond(), "condition false" }
}

// Poll is Until for code without a testing.TB (TestMain, helpers that start
// processes and return errors): it returns nil once cond holds, cond's error
// at once when it gives one (the state can no longer come), and an error
// naming what and the last state when ctx ends first.
func Poll(ctx context.Context, what string, cond func() (bool, string, error)) error {
	return PollEvery(ctx, interval, what, cond)
}

// PollEvery is Poll looking every `every`.
func PollEvery(ctx context.Context, every time.Duration, what string, cond func() (bool, string, error)) error {
	var last string
	for {
		ok, state, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		last = state
		select {
		case <-ctx.Done():
			return fmt.Errorf("timed out waiting for %s: %s (%w)", what, last, ctx.Err())
		case <-time.After(every):
		}
	}
}
