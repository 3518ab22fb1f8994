package chart

import (
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
	// firing: identifying label value (vm or backend) -> whether it must be firing at some point.
	firing map[string]bool
	// notBefore: no alert may fire before this much of the history.
	notBefore time.Duration
}

// TestAlertsFireOnStuckQueues evaluates the rendered default alerts, as
// Prometheus's rule manager does, over series shaped like a stuck and a
// healthy queue: each alert fires on the stuck one, after its `for`, and
// stays quiet on the healthy one.
func TestAlertsFireOnStuckQueues(t *testing.T) {
	r := renderVals(t, map[string]interface{}{"metrics": map[string]interface{}{"prometheusRule": map[string]interface{}{"enabled": true}}})
	byName := map[string]monitoringv1.Rule{}
	for _, rule := range renderedRules(t, r) {
		byName[rule.Alert] = rule
	}
	const target = `namespace="kube-system",pod="harvester-csi-driver-controllers-0"`
	cases := map[string][]alertCase{
		"HarvesterCSIHotplugQueueNotDraining": {{
			name: "stuck and growing backlogs fire, a queue that empties does not",
			series: `
harvester_csi_hotplug_queue_depth{backend="declarative",vm="stuck",` + target + `} 3+0x40
harvester_csi_hotplug_queue_depth{backend="declarative",vm="growing",` + target + `} 1+1x40
harvester_csi_hotplug_queue_depth{backend="declarative",vm="churn",` + target + `} 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale 3 2 1 stale
harvester_csi_hotplug_queue_depth{backend="declarative",vm="busy",` + target + `} 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2 5 4 3 2
`,
			firing:    map[string]bool{"stuck": true, "growing": true, "churn": false, "busy": false},
			notBefore: 15 * time.Minute,
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
			name: "a third of the changes failing fires, one in eleven does not",
			series: `
harvester_csi_hotplug_change_results_total{backend="declarative",result="failed",` + target + `} 0+5x40
harvester_csi_hotplug_change_results_total{backend="declarative",result="applied",` + target + `} 0+10x40
harvester_csi_hotplug_change_results_total{backend="subresource",result="failed",` + target + `} 0+1x40
harvester_csi_hotplug_change_results_total{backend="subresource",result="applied",` + target + `} 0+10x40
`,
			firing:    map[string]bool{"declarative": true, "subresource": false},
			notBefore: 10 * time.Minute,
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

// evalAlert evaluates the rule once a minute over the history the way
// Prometheus's rule manager does: an output series is pending from the first
// evaluation that returns it and firing once it has been returned at every
// evaluation for the rule's `for`; each firing alert's annotations are
// expanded as Prometheus expands them.
var labelRef = regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)

func evalAlert(t *testing.T, rule monitoringv1.Rule, c alertCase) {
	ctx := context.Background()
	storage := loadSeries(t, c.series)
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1_000_000, Timeout: time.Minute, LookbackDelta: 5 * time.Minute})
	t.Cleanup(func() { _ = engine.Close() })
	hold, err := model.ParseDuration(string(*rule.For))
	if err != nil {
		t.Fatal(err)
	}
	active := map[uint64]time.Duration{} // series -> first evaluation of its current run
	fired := map[string]bool{}
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
			id := lbls["vm"]
			if id == "" {
				id = lbls["backend"]
			}
			if !fired[id] && step < c.notBefore {
				t.Errorf("%s fired at %v, before %v", id, step, c.notBefore)
			}
			fired[id] = true
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
	for id, want := range c.firing {
		if fired[id] != want {
			t.Errorf("%s fired: %v, want %v", id, fired[id], want)
		}
	}
}

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
