package simhost

import (
	"context"
	"strings"
	"testing"
	"time"
)

// A VMI that does not start is restarted, and the start then succeeds.
func TestStartRunningRestartsAVMIThatDoesNotStart(t *testing.T) {
	restarts := 0
	running := func(context.Context) (bool, string) { return restarts > 0, "VMI Pending" }
	restart := func(context.Context) error { restarts++; return nil }
	if err := startRunning(context.Background(), "node-0", 3, 50*time.Millisecond, running, restart); err != nil {
		t.Fatalf("startRunning: %v", err)
	}
	if restarts != 1 {
		t.Errorf("restarted %d times, want 1", restarts)
	}
}

// A VMI that never starts is restarted attempts-1 times, then waited for until
// the caller gives up; the error says what was seen last.
func TestStartRunningGivesUpWithTheLastState(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	restarts := 0
	running := func(context.Context) (bool, string) { return false, "VMI Pending" }
	restart := func(context.Context) error {
		restarts++
		if restarts == 2 {
			cancel() // the caller gives up during the last attempt
		}
		return nil
	}
	err := startRunning(ctx, "node-0", 3, 20*time.Millisecond, running, restart)
	if err == nil || !strings.Contains(err.Error(), "VMI Pending") || !strings.Contains(err.Error(), "node-0") {
		t.Fatalf("startRunning = %v, want an error naming the VM and its last state", err)
	}
	if restarts != 2 {
		t.Errorf("restarted %d times, want 2", restarts)
	}
}
