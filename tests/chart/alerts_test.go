package chart

import (
	"cmp"
	"context"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/histogram"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/template"
	"github.com/prometheus/prometheus/tsdb/chunkenc"
	"github.com/prometheus/prometheus/tsdb/chunks"
	"github.com/prometheus/prometheus/util/annotations"
	"sigs.k8s.io/yaml"
)

// TestPrometheusRuleLoadsInPrometheus: the rendered rule groups pass
// Prometheus's own rule-file checks (what `promtool check rules` runs: PromQL,
// durations, label names, and the annotation templates).
func TestPrometheusRuleLoadsInPrometheus(t *testing.T) {
	for _, vs := range valueSets(t) {
		r := renderSet(t, vs)
		if r.find("PrometheusRule", ruleName) == nil {
			continue
		}
		t.Run(vs.name, func(t *testing.T) {
			pr := typed[monitoringv1.PrometheusRule](t, r.must(t, "PrometheusRule", ruleName))
			file, err := yaml.Marshal(map[string]interface{}{"groups": pr.Spec.Groups})
			if err != nil {
				t.Fatal(err)
			}
			if _, errs := rulefmt.Parse(file, false, model.UTF8Validation); len(errs) > 0 {
				t.Errorf("Prometheus refuses the rules:\n%s\n%v", file, errs)
			}
		})
	}
}

// alertCase is a history of series (one per line in the notation of
// Prometheus's rule tests: `metric{labels} 1+1x10 stale 3`, one sample a
// minute) and the alerts it must and must not raise by its end.
type alertCase struct {
	name   string
	series string
	// firing: identifying label value -> whether it must be firing at some point.
	firing map[string]bool
	// notBefore: no alert may fire before this much of the history.
	notBefore time.Duration
	// id is the label that tells the alert's series apart; empty: vm, else backend.
	id string
}

// TestAlertsFireOnStuckQueues evaluates the rendered default alerts, as
// Prometheus's rule manager does, over series shaped like the trouble each
// alert is for and like a healthy driver: each alert fires on the first,
// after its `for`, and stays quiet on the second.
func TestAlertsFireOnStuckQueues(t *testing.T) {
	byName := defaultAlerts(t)
	const target = `namespace="kube-system",pod="harvester-csi-driver-controllers-0"`
	// scraped gives a series the labels the ServiceMonitor's scrape adds, in
	// namespace ns (the alerts that sum over pods keep only the namespace,
	// so the cases tell their series apart by it).
	scraped := func(ns string) string { return `namespace="` + ns + `",pod="harvester-csi-driver-controllers-0"` }
	// The Service the chart's ServiceMonitor scrapes the controller through:
	// the Prometheus Operator names the job after it (prometheus-operator
	// v0.86.0 pkg/apis/monitoring/v1/servicemonitor_types.go, jobLabel).
	job := controllerName + "-metrics"
	const publish = `csi_sidecar_operations_seconds_count{driver_name="driver.harvesterhci.io",method_name="/csi.v1.Controller/ControllerPublishVolume",`
	cases := map[string][]alertCase{
		"HarvesterCSIHotplugQueueNotDraining": {{
			name: "stuck and growing backlogs fire, queues that empty or shrink do not",
			series: `
harvester_csi_hotplug_queue_depth{backend="declarative",vm="stuck",` + target + `} 3+0x40
harvester_csi_hotplug_queue_depth{backend="declarative",vm="growing",` + target + `} 1+1x40
harvester_csi_hotplug_queue_depth{backend="declarative",vm="churn",` + target + `} 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale
harvester_csi_hotplug_queue_depth{backend="declarative",vm="busy",` + target + `} 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2
harvester_csi_hotplug_queue_depth{backend="declarative",vm="slow",` + target + `} 10 10 10 10 9 9 9 9 8 8 8 8 7 7 7 7 6 6 6 6 5 5 5 5 4 4 4 4 3 3 3 3 2 2 2 2 1 1 1 1
`,
			firing:    map[string]bool{"stuck": true, "growing": true, "churn": false, "busy": false, "slow": false},
			notBefore: 7 * time.Minute,
		}},
		"HarvesterCSIHotplugIntentWaitingLong": {{
			name: "an intent older than 5 minutes fires, intents that complete do not",
			series: `
harvester_csi_hotplug_oldest_intent_age_seconds{backend="declarative",vm="stuck",` + target + `} 0+60x40
harvester_csi_hotplug_oldest_intent_age_seconds{backend="declarative",vm="churn",` + target + `} 10 70 130 stale 10 70 130 stale 10 70 130 stale 10 70 130 stale 10 70 130 stale 10 70 130 stale 10 70 130 stale 10 70 130 stale 10 70 130 stale 10 70 130 stale
`,
			firing:    map[string]bool{"stuck": true, "churn": false},
			notBefore: 6 * time.Minute,
		}},
		"HarvesterCSIHotplugVMWedged": {{
			name: "a wedge that lasts fires; none, and one that clears at once, do not",
			series: `
harvester_csi_hotplug_wedged_intents{backend="declarative",reason="plug",` + scraped("wedged") + `} 0+0x10 1+0x30
harvester_csi_hotplug_wedged_intents{backend="declarative",reason="plug",` + scraped("healthy") + `} 0+0x40
harvester_csi_hotplug_wedged_intents{backend="declarative",reason="plug",` + scraped("blip") + `} 0+0x10 1 0+0x29
`,
			firing:    map[string]bool{"wedged": true, "healthy": false, "blip": false},
			notBefore: 11 * time.Minute,
			id:        "namespace",
		}},
		"HarvesterCSIHotplugVolumesRejected": {{
			name: "the first rejection after a start fires (the counter is exported at zero)",
			series: `
harvester_csi_hotplug_change_results_total{backend="declarative",result="rejected",` + target + `} 0+0x10 1+0x30
harvester_csi_hotplug_change_results_total{backend="declarative",result="applied",` + target + `} 0+5x40
harvester_csi_hotplug_change_results_total{backend="subresource",result="rejected",` + target + `} 0+0x40
harvester_csi_hotplug_change_results_total{backend="subresource",result="applied",` + target + `} 0+5x40
`,
			firing:    map[string]bool{"declarative": true, "subresource": false},
			notBefore: 10 * time.Minute,
		}},
		"HarvesterCSIHotplugHostErrors": {{
			name: "a host that stopped answering fires; one failure in two changes, a lone timeout and refusals do not",
			// down: the reads fail before any change is sent, so no change
			// result moves (a ratio of change results is 0/0 here).
			series: `
harvester_csi_hotplug_host_failures_total{backend="declarative",cause="unavailable",` + scraped("down") + `} 0+0x10 8+1x30
harvester_csi_hotplug_change_results_total{backend="declarative",result="failed",` + scraped("down") + `} 0+0x40
harvester_csi_hotplug_change_results_total{backend="declarative",result="applied",` + scraped("down") + `} 0+0x40
harvester_csi_hotplug_host_failures_total{backend="declarative",cause="other",` + scraped("flaky") + `} 0+0x10 1+0x30
harvester_csi_hotplug_change_results_total{backend="declarative",result="failed",` + scraped("flaky") + `} 0+0x10 1+0x30
harvester_csi_hotplug_change_results_total{backend="declarative",result="applied",` + scraped("flaky") + `} 0+0x10 1+0x30
harvester_csi_hotplug_host_failures_total{backend="declarative",cause="unavailable",` + scraped("busy") + `} 0+0x20 1+0x20
harvester_csi_hotplug_change_results_total{backend="declarative",result="applied",` + scraped("busy") + `} 0+10x40
harvester_csi_hotplug_host_failures_total{backend="declarative",cause="refused",` + scraped("refused") + `} 0+2x40
`,
			firing:    map[string]bool{"down": true, "flaky": false, "busy": false, "refused": false},
			notBefore: 10 * time.Minute,
			id:        "namespace",
		}},
		"HarvesterCSIHostCredentialsRefused": {{
			name: "refused hotplug attempts and 401s from the host fire; 401s from the guest, 403s of reads and timeouts do not",
			// expired: the 401 series is born at its first answer, as
			// client-go's request counter is; its growth shows it.
			series: `
harvester_csi_hotplug_host_failures_total{backend="declarative",cause="refused",` + scraped("rbac") + `} 0+0x10 1+1x30
harvester_csi_api_requests_total{cluster="host",code="401",verb="GET",` + scraped("expired") + `} _x10 1+1x30
harvester_csi_api_requests_total{cluster="guest",code="401",verb="GET",` + scraped("guest") + `} 0+1x40
harvester_csi_api_requests_total{cluster="host",code="403",verb="GET",` + scraped("forbidden-read") + `} 0+1x40
harvester_csi_hotplug_host_failures_total{backend="declarative",cause="unavailable",` + scraped("down") + `} 0+1x40
`,
			firing:    map[string]bool{"rbac": true, "expired": true, "guest": false, "forbidden-read": false, "down": false},
			notBefore: 10 * time.Minute,
			id:        "namespace",
		}},
		"HarvesterCSIHostTokenExpiring": {{
			name: "a token expiring within 14 days or expired fires; one of 30 days, a rotated one and none known do not",
			// The evaluation runs at Unix time 0 to 40 min.
			series: `
harvester_csi_host_token_expiry_timestamp_seconds{` + scraped("soon") + `} 864000+0x40
harvester_csi_host_token_expiry_timestamp_seconds{` + scraped("expired") + `} -3600+0x40
harvester_csi_host_token_expiry_timestamp_seconds{` + scraped("fresh") + `} 2592000+0x40
harvester_csi_host_token_expiry_timestamp_seconds{` + scraped("rotated") + `} 864000+0x4 2592000+0x35
harvester_csi_build_info{commit="abc",go_version="go1.26.0",version="v0.3.0",` + scraped("unknown") + `} 1+0x40
`,
			firing:    map[string]bool{"soon": true, "expired": true, "fresh": false, "rotated": false, "unknown": false},
			notBefore: 10 * time.Minute,
			id:        "namespace",
		}},
		"HarvesterCSIMetricsTargetDown": {
			{
				name: "an endpoint of the controller that stops answering fires, one of another job does not",
				series: `
up{job="` + job + `",endpoint="metrics",` + target + `} 1+0x40
up{job="` + job + `",endpoint="attacher-http",` + target + `} 1+0x10 0+0x30
up{job="other",endpoint="web",` + target + `} 0+0x40
`,
				firing:    map[string]bool{"metrics": false, "attacher-http": true, "web": false},
				notBefore: 15 * time.Minute,
				id:        "endpoint",
			},
			{
				name: "no controller target at all fires",
				series: `
up{job="other",endpoint="web",` + target + `} 1+0x40
`,
				firing:    map[string]bool{job: true, "other": false},
				notBefore: 5 * time.Minute,
				id:        "job",
			},
		},
		"HarvesterCSIAttacherPublishErrors": {{
			name: "publishes that keep failing fire; failures amid a rollout's successes, one in two, unpublishes and other drivers do not",
			series: `
` + publish + `grpc_status_code="Unavailable",` + scraped("failing") + `} 0+3x40
` + publish + `grpc_status_code="OK",` + scraped("rollout") + `} 0+20x40
` + publish + `grpc_status_code="FailedPrecondition",` + scraped("rollout") + `} 0+2x40
` + publish + `grpc_status_code="OK",` + scraped("one-in-two") + `} 0+0x10 1+0x30
` + publish + `grpc_status_code="Aborted",` + scraped("one-in-two") + `} 0+0x10 1+0x30
csi_sidecar_operations_seconds_count{driver_name="driver.harvesterhci.io",method_name="/csi.v1.Controller/ControllerUnpublishVolume",grpc_status_code="Unavailable",` + scraped("unpublish") + `} 0+3x40
csi_sidecar_operations_seconds_count{driver_name="other.csi.example.com",method_name="/csi.v1.Controller/ControllerPublishVolume",grpc_status_code="Unavailable",` + scraped("other-driver") + `} 0+3x40
`,
			firing:    map[string]bool{"failing": true, "rollout": false, "one-in-two": false, "unpublish": false, "other-driver": false},
			notBefore: 10 * time.Minute,
			id:        "namespace",
		}},
	}
	for name := range alertSpecs {
		if _, ok := cases[name]; !ok {
			t.Errorf("alert %s has no evaluation case", name)
		}
	}
	for name, cs := range cases {
		rule, ok := byName[name]
		if !ok {
			t.Errorf("alert %s is not rendered with default values", name)
			continue
		}
		for _, c := range cs {
			t.Run(name+"/"+c.name, func(t *testing.T) { evalAlert(t, rule, c) })
		}
	}
}

// TestAlertOrderQueueAndIntent: the two waiting alerts say different things.
// IntentWaitingLong is about one change being late; QueueNotDraining about a
// VM's backlog making no net progress. A VM where nothing moves raises both at
// about the same time (QueueNotDraining no later); a backlog that grows while
// each change is still young raises QueueNotDraining well before any change is
// old; one change stuck while the rest of the VM's queue flows raises only
// IntentWaitingLong.
func TestAlertOrderQueueAndIntent(t *testing.T) {
	byName := defaultAlerts(t)
	queue, intent := byName["HarvesterCSIHotplugQueueNotDraining"], byName["HarvesterCSIHotplugIntentWaitingLong"]
	const target = `backend="declarative",vm="vm-a",namespace="kube-system",pod="harvester-csi-driver-controllers-0"`
	for _, c := range []struct {
		name, depth, age string
		// queueFirst: QueueNotDraining fires strictly before IntentWaitingLong;
		// else no later. queueFires false: it must not fire at all.
		queueFirst, queueFires bool
	}{
		{name: "nothing moves", depth: "3+0x40", age: "0+60x40", queueFires: true},
		{name: "backlog grows, changes young", depth: "2+1x40", age: "0+15x40", queueFires: true, queueFirst: true},
		{name: "one change stuck, the rest flows", depth: "5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2", age: "0+60x40"},
	} {
		t.Run(c.name, func(t *testing.T) {
			series := "harvester_csi_hotplug_queue_depth{" + target + "} " + c.depth + "\n" +
				"harvester_csi_hotplug_oldest_intent_age_seconds{" + target + "} " + c.age
			q, qOK := firings(t, queue, series, "vm")["vm-a"]
			i, iOK := firings(t, intent, series, "vm")["vm-a"]
			if !iOK {
				t.Fatalf("IntentWaitingLong never fired")
			}
			switch {
			case qOK != c.queueFires:
				t.Errorf("QueueNotDraining fired: %v (at %v), want %v", qOK, q, c.queueFires)
			case !qOK:
			case c.queueFirst && q >= i:
				t.Errorf("QueueNotDraining fired at %v, IntentWaitingLong at %v: the growing backlog should be reported first", q, i)
			case q > i:
				t.Errorf("QueueNotDraining fired at %v, after IntentWaitingLong at %v", q, i)
			}
		})
	}
}

func defaultAlerts(t *testing.T) map[string]monitoringv1.Rule {
	t.Helper()
	r := renderVals(t, map[string]interface{}{"metrics": map[string]interface{}{"prometheusRule": map[string]interface{}{"enabled": true}}})
	byName := map[string]monitoringv1.Rule{}
	for _, rule := range renderedRules(t, r) {
		byName[rule.Alert] = rule
	}
	return byName
}

// evalAlert checks that the alerts of c fire, or not, and never before
// c.notBefore.
func evalAlert(t *testing.T, rule monitoringv1.Rule, c alertCase) {
	fired := firings(t, rule, c.series, c.id)
	for id, at := range fired {
		if at < c.notBefore {
			t.Errorf("%s fired at %v, before %v", id, at, c.notBefore)
		}
	}
	for id, want := range c.firing {
		if _, ok := fired[id]; ok != want {
			t.Errorf("%s fired: %v, want %v", id, ok, want)
		}
	}
}

// firings evaluates the rule once a minute over the history the way
// Prometheus's rule manager does: an output series is pending from the first
// evaluation that returns it and firing once it has been returned at every
// evaluation for the rule's `for`; each firing alert's annotations are
// expanded as Prometheus expands them. It returns when each alert, named by
// its label idLabel (empty: vm, else backend), first fired.
func firings(t *testing.T, rule monitoringv1.Rule, series, idLabel string) map[string]time.Duration {
	t.Helper()
	ctx := context.Background()
	storage := loadSeries(t, series)
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1_000_000, Timeout: time.Minute, LookbackDelta: 5 * time.Minute})
	t.Cleanup(func() { _ = engine.Close() })
	hold, err := model.ParseDuration(string(*rule.For))
	if err != nil {
		t.Fatal(err)
	}
	active := map[uint64]time.Duration{} // series -> first evaluation of its current run
	fired := map[string]time.Duration{}
	start := time.Unix(0, 0).UTC()
	for step := time.Duration(0); step <= 40*time.Minute; step += time.Minute {
		q, err := engine.NewInstantQuery(ctx, storage, nil, rule.Expr.String(), start.Add(step))
		if err != nil {
			t.Fatal(err)
		}
		res := q.Exec(ctx)
		q.Close()
		vec, err := res.Vector()
		if err != nil {
			t.Fatalf("evaluate at %v: %v", step, err)
		}
		seen := map[uint64]bool{}
		for _, smpl := range vec {
			h := smpl.Metric.Hash()
			seen[h] = true
			since, ok := active[h]
			if !ok {
				active[h], since = step, step
			}
			if step-since < time.Duration(hold) {
				continue
			}
			lbls := smpl.Metric.Map()
			delete(lbls, labels.MetricName)
			id := lbls[idLabel]
			if idLabel == "" {
				id = cmp.Or(lbls["vm"], lbls["backend"])
			}
			if _, ok := fired[id]; !ok {
				fired[id] = step
			}
			for name, text := range rule.Annotations {
				tmpl := template.NewTemplateExpander(ctx,
					"{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}{{$externalURL := .ExternalURL}}{{$value := .Value}}"+text,
					"__alert_"+rule.Alert, template.AlertTemplateData(lbls, nil, "", smpl), model.Time(step.Milliseconds()), nil, nil, nil)
				out, err := tmpl.Expand()
				if err != nil || strings.Contains(out, "<no value>") {
					t.Errorf("annotation %s of %s: %q (%v)", name, id, out, err)
				}
				for _, m := range labelRef.FindAllStringSubmatch(text, -1) {
					if lbls[m[1]] == "" {
						t.Errorf("annotation %s uses $labels.%s, which the alert does not carry: %v", name, m[1], lbls)
					}
				}
			}
		}
		for h := range active {
			if !seen[h] {
				delete(active, h)
			}
		}
	}
	return fired
}

var labelRef = regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)

// loadSeries reads series in the notation of Prometheus's rule tests, one
// sample a minute from time 0, into an in-memory storage (Prometheus's test
// storage is a full TSDB, which would bring its cloud clients along).
func loadSeries(t *testing.T, text string) memQuerier {
	t.Helper()
	var out memQuerier
	for _, line := range strings.Split(strings.TrimSpace(text), "\n") {
		lbls, vals, err := parser.ParseSeriesDesc(line)
		if err != nil {
			t.Fatalf("series %q: %v", line, err)
		}
		var samples chunks.SampleSlice
		for i, v := range vals {
			if !v.Omitted {
				samples = append(samples, floatSample{t: (time.Duration(i) * time.Minute).Milliseconds(), f: v.Value})
			}
		}
		out = append(out, storage.NewListSeries(lbls, samples))
	}
	return out
}

// memQuerier is a storage.Queryable and storage.Querier over fixed series.
type memQuerier []storage.Series

func (q memQuerier) Querier(int64, int64) (storage.Querier, error) { return q, nil }

func (q memQuerier) Select(_ context.Context, sortSeries bool, _ *storage.SelectHints, ms ...*labels.Matcher) storage.SeriesSet {
	var out []storage.Series
	for _, s := range q {
		if slices.ContainsFunc(ms, func(m *labels.Matcher) bool { return !m.Matches(s.Labels().Get(m.Name)) }) {
			continue
		}
		out = append(out, s)
	}
	if sortSeries {
		slices.SortFunc(out, func(a, b storage.Series) int { return labels.Compare(a.Labels(), b.Labels()) })
	}
	return &seriesSet{series: out, i: -1}
}

func (q memQuerier) LabelValues(context.Context, string, *storage.LabelHints, ...*labels.Matcher) ([]string, annotations.Annotations, error) {
	return nil, nil, nil
}

func (q memQuerier) LabelNames(context.Context, *storage.LabelHints, ...*labels.Matcher) ([]string, annotations.Annotations, error) {
	return nil, nil, nil
}

func (q memQuerier) Close() error { return nil }

type seriesSet struct {
	series []storage.Series
	i      int
}

func (s *seriesSet) Next() bool                        { s.i++; return s.i < len(s.series) }
func (s *seriesSet) At() storage.Series                { return s.series[s.i] }
func (s *seriesSet) Err() error                        { return nil }
func (s *seriesSet) Warnings() annotations.Annotations { return nil }

type floatSample struct {
	t int64
	f float64
}

func (s floatSample) T() int64                      { return s.t }
func (s floatSample) F() float64                    { return s.f }
func (s floatSample) H() *histogram.Histogram       { return nil }
func (s floatSample) FH() *histogram.FloatHistogram { return nil }
func (s floatSample) Type() chunkenc.ValueType      { return chunkenc.ValFloat }
func (s floatSample) Copy() chunks.Sample           { return s }
