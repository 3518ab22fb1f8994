package lab

import (
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

func TestHostCase(t *testing.T) {
	for _, tc := range []struct {
		vmHost string
		held   []string
		want   string
	}{
		{"harvester-0", []string{"harvester-0"}, CaseOnHostNode},
		{"harvester-0", nil, CaseFresh},
		{"harvester-0", []string{"harvester-1"}, CaseMoved},
		// Still held on the old node too: the new one waits for it.
		{"harvester-0", []string{"harvester-0", "harvester-1"}, CaseMoved},
		{"", []string{"harvester-1"}, ""},
	} {
		if got := hostCase(tc.vmHost, tc.held); got != tc.want {
			t.Errorf("VM on %q, host holds the volume on %v: %q, want %q", tc.vmHost, tc.held, got, tc.want)
		}
	}
}

// The report splits the latencies by case with each case's count, share
// and percentiles, in a fixed order, and says nothing without cases.
func TestByCase(t *testing.T) {
	var samples []monitor.Sample
	add := func(c string, secs ...float64) {
		for _, s := range secs {
			samples = append(samples, monitor.Sample{Seconds: s, Case: c})
		}
	}
	add(CaseMoved, 30, 40)
	add(CaseOnHostNode, 2, 3, 4, 5)
	add(CaseFresh, 12, 14, 20)
	add("", 9)
	got := byCase(samples)
	if len(got) != 4 {
		t.Fatalf("got %+v, want four cases", got)
	}
	want := []struct {
		c     string
		n     int
		share float64
		p50   float64
		max   float64
	}{{CaseOnHostNode, 4, 0.4, 3, 5}, {CaseFresh, 3, 0.3, 14, 20}, {CaseMoved, 2, 0.2, 30, 40}, {"", 1, 0.1, 9, 9}}
	for i, w := range want {
		g := got[i]
		if g.Case != w.c || g.Count != w.n || g.Share != w.share || g.Latency.P50 != w.p50 || g.Latency.Max != w.max || g.Latency.N != w.n {
			t.Errorf("case %d: got %+v, want %s n=%d share %.1f p50 %g max %g", i, g, w.c, w.n, w.share, w.p50, w.max)
		}
	}
	if byCase([]monitor.Sample{{Seconds: 1}, {Seconds: 2}}) != nil {
		t.Error("samples without a case (no host nodes) gave a split")
	}
	rep := &Report{AttachByCase: got}
	s := rep.Summary()
	for _, line := range []string{"attach latency by where the host had the volume", "already on that host node:", "moved between host nodes:     2 ( 20%)  p50   30.0s"} {
		if !strings.Contains(s, line) {
			t.Errorf("summary lacks %q:\n%s", line, s)
		}
	}
}

// The host's part of each attachment pod: created to scheduled, scheduled
// to its volumes attached (0 when they were there already), attached to
// Running; a pod whose attach was not seen counts for scheduling only.
func TestHostSplit(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	pods := []hostPodTimes{
		{Created: at(0), Scheduled: at(1), Attached: at(11), Running: at(13)},  // fresh attach
		{Created: at(0), Scheduled: at(20), Attached: at(-5), Running: at(22)}, // cordoned 20 s; volumes already there
		{Created: at(0), Scheduled: at(2), Running: at(30)},                    // attach not seen
		{Created: at(0), Scheduled: at(2)},                                     // never ran: left out
	}
	got := hostSplit(pods)
	if got == nil {
		t.Fatal("no split")
	}
	if got.Scheduling.N != 3 || got.Scheduling.Max != 20 {
		t.Errorf("scheduling %+v, want 3 pods, max 20 s", got.Scheduling)
	}
	if got.Attach.N != 2 || got.Attach.Max != 10 || got.Attach.P50 != 0 {
		t.Errorf("host attach %+v, want 2 pods: 10 s and 0 s", got.Attach)
	}
	if got.Start.N != 2 || got.Start.Max != 2 {
		t.Errorf("pod start %+v, want 2 pods of 2 s", got.Start)
	}
	if hostSplit([]hostPodTimes{{Created: at(0)}}) != nil {
		t.Error("no pod ran, yet a split")
	}
	bd := withHost(nil, got)
	rep := &Report{DriverBreakdown: bd}
	if s := rep.Summary(); !strings.Contains(s, "host attach:") || strings.Contains(s, "attach held:") {
		t.Errorf("a host part without the controller's split: summary\n%s", s)
	}
}
