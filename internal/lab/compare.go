package lab

import (
	"fmt"
	"sort"
	"strings"
)

// Compare prints two runs of the same scenario side by side.
func Compare(a, b *Report) string {
	var s strings.Builder
	row := func(name, x, y string) { fmt.Fprintf(&s, "  %-37s %-24s %-24s\n", name, x, y) }
	f := func(v float64) string { return fmt.Sprintf("%.1fs", v) }
	d := func(v int) string { return fmt.Sprint(v) }
	fmt.Fprintf(&s, "comparison (same scenario, seed %d)\n", a.Config.Seed)
	row("", "this driver", "compared")
	row("controller binary", short(a.Driver.Binary), short(b.Driver.Binary))
	row("passed", fmt.Sprint(a.Passed), fmt.Sprint(b.Passed))
	row("stuck", d(a.Stuck), d(b.Stuck))
	row("invariant violations", d(len(a.InvariantViolations)), d(len(b.InvariantViolations)))
	row("attaches / detaches", fmt.Sprintf("%d / %d", a.Operations.Attaches, a.Operations.Detaches), fmt.Sprintf("%d / %d", b.Operations.Attaches, b.Operations.Detaches))
	row("jobs run", d(a.Operations.JobsRun), d(b.Operations.JobsRun))
	for _, p := range []struct {
		name string
		x, y pcts
	}{
		{"attach (VA created -> attached)", pct(a.AttachLatency.P50, a.AttachLatency.P95, a.AttachLatency.P99), pct(b.AttachLatency.P50, b.AttachLatency.P95, b.AttachLatency.P99)},
		{"detach (VA deleted -> gone)", pct(a.DetachLatency.P50, a.DetachLatency.P95, a.DetachLatency.P99), pct(b.DetachLatency.P50, b.DetachLatency.P95, b.DetachLatency.P99)},
		{"pod created -> Running", pct(a.PodStartLatency.P50, a.PodStartLatency.P95, a.PodStartLatency.P99), pct(b.PodStartLatency.P50, b.PodStartLatency.P95, b.PodStartLatency.P99)},
	} {
		row(p.name+" p50", f(p.x[0]), f(p.y[0]))
		row("  p95", f(p.x[1]), f(p.y[1]))
		row("  p99", f(p.x[2]), f(p.y[2]))
	}
	if a.Config.ExpandEvery > 0 {
		ex := func(r *Report) string { return fmt.Sprintf("%d / %.1fs", r.Operations.Expansions, r.ExpandLatency.P50) }
		row("claim expansions / p50", ex(a), ex(b))
	}
	row("data checks passed / failed", fmt.Sprintf("%d / %d", a.DataChecks.Passed, a.DataChecks.Failed), fmt.Sprintf("%d / %d", b.DataChecks.Passed, b.DataChecks.Failed))
	row("KubeVirt writes per volume op", fmt.Sprintf("%.2f", a.KubeVirtWrites.PerVolumeOp), fmt.Sprintf("%.2f", b.KubeVirtWrites.PerVolumeOp))
	row("409 conflicts", d(a.Conflicts["409"]), d(b.Conflicts["409"]))
	row("422 unprocessable", d(a.Conflicts["422"]), d(b.Conflicts["422"]))
	if len(a.WebhookDenials)+len(b.WebhookDenials) > 0 {
		total := func(m map[string]int) (n int) {
			for _, v := range m {
				n += v
			}
			return n
		}
		row("refused by a webhook (not conflicts)", d(total(a.WebhookDenials)), d(total(b.WebhookDenials)))
	}
	msgs := map[string]bool{}
	for m := range a.AttacherErrors {
		msgs[m] = true
	}
	for m := range b.AttacherErrors {
		msgs[m] = true
	}
	if len(msgs) > 0 {
		fmt.Fprintf(&s, "  errors seen by the attacher (this driver / compared):\n")
		var keys []string
		for m := range msgs {
			keys = append(keys, m)
		}
		sort.Slice(keys, func(i, j int) bool {
			return a.AttacherErrors[keys[i]]+b.AttacherErrors[keys[i]] > a.AttacherErrors[keys[j]]+b.AttacherErrors[keys[j]]
		})
		for i, m := range keys {
			if i == 15 {
				fmt.Fprintf(&s, "    ... %d more\n", len(keys)-15)
				break
			}
			fmt.Fprintf(&s, "    %5d / %-5d %s\n", a.AttacherErrors[m], b.AttacherErrors[m], m)
		}
	}
	return s.String()
}

// pcts is p50, p95 and p99.
type pcts [3]float64

func pct(a, b, c float64) pcts { return pcts{a, b, c} }

func short(s string) string {
	if len(s) > 24 {
		return "..." + s[len(s)-21:]
	}
	return s
}
