package simlonghorn

import (
	"math/rand"
	"testing"
	"time"
)

// bareSim is a stand-in with no API server behind it, for the switches that
// only change its own state.
func bareSim(opts Options) *Sim {
	return &Sim{opts: opts, rng: rand.New(rand.NewSource(1)), stages: map[string]*stage{}, //nolint:gosec // jitter
		faulted: map[string]time.Time{}, lag: map[string]*lagging{}, ghosts: map[string]WorkloadStatus{},
		slowDetach: opts.Faults.SlowDetach}
}

// The lab slows the host's teardown for a while and then lets it go back
// to normal: the detach stage follows the switch while the stand-in runs.
func TestSetSlowDetachWhileRunning(t *testing.T) {
	s := bareSim(Options{Scale: 1, Faults: Faults{SlowDetach: 2}})
	if got := s.detachTime(); got != 2*realDetach {
		t.Fatalf("Faults.SlowDetach 2: detach %s, want %s", got, 2*realDetach)
	}
	s.SetSlowDetach(10)
	if got := s.detachTime(); got != 10*realDetach {
		t.Errorf("SetSlowDetach(10): detach %s, want %s", got, 10*realDetach)
	}
	s.SetSlowDetach(0)
	if got := s.detachTime(); got != realDetach {
		t.Errorf("SetSlowDetach(0): detach %s, want the normal %s", got, realDetach)
	}
}

// A fault on the lab's wall-clock schedule ends when the lab says, whatever
// the stand-in's scale, and the volume comes due for a pass then.
func TestFaultVolumeUntilIsOnTheWallClock(t *testing.T) {
	s := bareSim(Options{Scale: 0.01})
	now := time.Now()
	until := now.Add(time.Minute)
	s.FaultVolumeUntil("vol", until)
	if !s.isFaulted("vol", now) || !s.isFaulted("vol", until.Add(-time.Millisecond)) {
		t.Fatal("not faulted before the end the lab gave")
	}
	if s.isFaulted("vol", until) {
		t.Error("still faulted at the end the lab gave")
	}
	if d, ok := s.nextDue("vol", now); !ok || d != time.Minute {
		t.Errorf("next pass in %s (%v), want at the fault's end, in 1m", d, ok)
	}
}
