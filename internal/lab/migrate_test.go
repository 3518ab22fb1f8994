package lab

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// fakeMigrator ends each migration after `polls` looks, in the phase given
// per VM (default Succeeded), and records what overlapped.
type fakeMigrator struct {
	mu       sync.Mutex
	polls    int
	refuse   map[string]bool
	end      map[string]kubevirtv1.VirtualMachineInstanceMigrationPhase
	started  []string
	running  map[string]int // migration -> looks so far
	overlaps int
}

func (f *fakeMigrator) migrate(_ context.Context, vm string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refuse[vm] {
		return "", errors.New("VMI is not running")
	}
	if len(f.running) > 0 {
		f.overlaps++
	}
	f.started = append(f.started, vm)
	name := fmt.Sprintf("%s-%d", vm, len(f.started))
	f.running[name] = 0
	return name, nil
}

func (f *fakeMigrator) finished(_ context.Context, vm, name string) (kubevirtv1.VirtualMachineInstanceMigrationPhase, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.running[name]++
	if f.running[name] < f.polls {
		return kubevirtv1.MigrationRunning, false
	}
	delete(f.running, name)
	if p, ok := f.end[vm]; ok {
		return p, true
	}
	return kubevirtv1.MigrationSucceeded, true
}

func newFake() *fakeMigrator {
	return &fakeMigrator{polls: 3, refuse: map[string]bool{}, end: map[string]kubevirtv1.VirtualMachineInstanceMigrationPhase{}, running: map[string]int{}}
}

func TestMigrateInTurnOneAtATime(t *testing.T) {
	f := newFake()
	f.refuse["node-1"] = true
	f.end["node-2"] = kubevirtv1.MigrationFailed
	var reported []string
	migrateInTurn(context.Background(), f, []string{"node-0", "node-1", "node-2", "node-3"}, time.Millisecond, func(vm string, err error) {
		reported = append(reported, vm+": "+err.Error())
	})
	if want := []string{"node-0", "node-2", "node-3"}; !slices.Equal(f.started, want) {
		t.Errorf("migrated %v, want %v", f.started, want)
	}
	if f.overlaps != 0 {
		t.Errorf("%d migrations started while another ran", f.overlaps)
	}
	want := []string{"node-1: VMI is not running", "node-2: migration node-2-2 ended Failed"}
	if !slices.Equal(reported, want) {
		t.Errorf("reported %q, want %q", reported, want)
	}
}

func TestMigrateInTurnStopsWithTheRun(t *testing.T) {
	f := newFake()
	f.polls = 1 << 30 // never ends
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		migrateInTurn(ctx, f, []string{"node-0", "node-1"}, time.Millisecond, func(vm string, err error) {
			t.Errorf("reported %s: %v", vm, err)
		})
	}()
	cancel()
	<-done
	if len(f.started) > 1 {
		t.Errorf("started %v after the run ended", f.started)
	}
}

// lateContext's deadline is in, or has passed by, in while its Done channel
// is still open: a client refuses to wait past a deadline a few tens of
// milliseconds ahead, and a deadline's timer fires a little after it.
type lateContext struct {
	context.Context
	in time.Duration
}

func (c lateContext) Deadline() (time.Time, bool) { return time.Now().Add(c.in), true }

// A migration refused as the run's deadline comes is the run ending, not a
// failed migration: the client refuses to wait past the deadline before
// the context says it is done.
func TestMigrateInTurnAtTheDeadlineReportsNothing(t *testing.T) {
	for _, in := range []time.Duration{-time.Millisecond, 50 * time.Millisecond} {
		f := newFake()
		f.refuse["node-0"] = true
		migrateInTurn(lateContext{context.Background(), in}, f, []string{"node-0", "node-1"}, time.Millisecond, func(vm string, err error) {
			t.Errorf("deadline in %s: reported %s: %v at the run's end", in, vm, err)
		})
		if len(f.started) != 0 {
			t.Errorf("deadline in %s: started %v at the run's end", in, f.started)
		}
	}
}

// KubeVirt's real control plane carries the fault's migrations out on host
// nodes; without them (the kubelet stand-in) it is refused, naming the flag.
// The simulator plays it either way.
func TestMigrateVMsNeedsHostNodesOnTheRealControlPlane(t *testing.T) {
	c := &Config{KubeVirt: RealPrefix + "v1.7.0", HostNodes: 3, MigrateVMsEvery: time.Minute}
	if _, err := c.simOptions(); err != nil {
		t.Errorf("simOptions with --migrate-vms and host nodes on %s: %v, want accepted", c.KubeVirt, err)
	}
	c.HostNodes = 0
	if _, err := c.simOptions(); err == nil || !strings.Contains(err.Error(), "--migrate-vms") || !strings.Contains(err.Error(), "--host-nodes") {
		t.Errorf("simOptions with --migrate-vms and no host nodes on %s: %v, want a refusal naming the flag and --host-nodes", c.KubeVirt, err)
	}
	c.KubeVirt = "v1.7.0"
	for _, n := range []int{0, 3} {
		c.HostNodes = n
		if _, err := c.simOptions(); err != nil {
			t.Errorf("simOptions with --migrate-vms and %d host nodes on the simulator: %v", n, err)
		}
	}
}
