// Package testwait is the one poll loop the tests share: they wait for state
// that other goroutines, processes or API servers change, never for a fixed
// time, because the CI machine is shared and its timing is not ours.
package testwait

import (
	"context"
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
	var last string
	for {
		ok, state := cond()
		if ok {
			return
		}
		last = state
		select {
		case <-ctx.Done():
			tb.Fatalf("timed out waiting for %s: %s", what, last)
		case <-time.After(interval):
		}
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
