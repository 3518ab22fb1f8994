package lab

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2"
)

// Every host fault needs the host storage path: without host nodes it is
// refused with the flag's name and what it needs, as are negative lengths
// and a period without a length.
func TestCheckHostFaults(t *testing.T) {
	for name, set := range map[string]func(c *Config){
		"--longhorn-faulted": func(c *Config) { c.LonghornFaulted = 5 * time.Second },
		"--cordon-host":      func(c *Config) { c.CordonHost = 5 * time.Second },
		"--slow-host-detach": func(c *Config) { c.SlowHostDetach = 5 * time.Second },
		"--ghost-workload":   func(c *Config) { c.GhostWorkload = 5 * time.Second },
	} {
		c := Config{}
		set(&c)
		err := c.CheckHostFaults()
		if err == nil || !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), "--host-nodes") {
			t.Errorf("%s without host nodes: %v, want a refusal naming %s and --host-nodes", name, err, name)
		}
		c.HostNodes = 3
		if err := c.CheckHostFaults(); err != nil {
			t.Errorf("%s with 3 host nodes: %v", name, err)
		}
	}
	bad := []Config{
		{HostNodes: 3, CordonHost: -time.Second},
		{HostNodes: 3, GhostWorkloadEvery: time.Minute},
	}
	for _, c := range bad {
		if err := c.CheckHostFaults(); err == nil {
			t.Errorf("%+v: accepted", c)
		}
	}
}

// A host fault still under way when the run ends is ended at once, on a
// context the run's end has not cancelled (a host node left cordoned would
// keep the quiesce from finishing), and the report has its start and end.
func TestHostFaultEndsWithTheRun(t *testing.T) {
	r := &run{log: klog.Background()}
	ctx, cancel := context.WithCancel(context.Background())
	var offErr error
	on := func(context.Context) error { cancel(); return nil } // the run ends while the fault is on
	off := func(ctx context.Context) error { offErr = ctx.Err(); return offErr }
	r.hostFault(ctx, faultCordonHost, "harvester-1", time.Hour, on, off)
	if offErr != nil {
		t.Fatalf("the fault was ended on a cancelled context: %v", offErr)
	}
	if len(r.faults) != 1 || r.faults[0].Fault != faultCordonHost || r.faults[0].Target != "harvester-1" ||
		r.faults[0].Start.IsZero() || r.faults[0].End.IsZero() {
		t.Fatalf("recorded %+v, want one cordon-host of harvester-1 with its start and end", r.faults)
	}
	rep := &Report{Passed: true, Outcome: "done", Started: r.faults[0].Start.Add(-3 * time.Second), HostFaults: r.faults}
	if s := rep.Summary(); !strings.Contains(s, "cordon-host on harvester-1 at +3s, for ") {
		t.Errorf("summary does not list the fault with its start and length:\n%s", s)
	}
}

// A fault that cannot start is not reported as played.
func TestHostFaultThatCannotStart(t *testing.T) {
	r := &run{log: klog.Background()}
	offCalled := false
	r.hostFault(context.Background(), faultCordonHost, "harvester-0", time.Hour,
		func(context.Context) error { return errors.New("nodes \"harvester-0\" not found") },
		func(context.Context) error { offCalled = true; return nil })
	if len(r.faults) != 0 || offCalled {
		t.Errorf("recorded %+v (off called: %v), want nothing", r.faults, offCalled)
	}
}
