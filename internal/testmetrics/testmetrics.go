// Package testmetrics reads what a test's Prometheus registry gathers: the
// one way tests look a metric up by name and labels.
package testmetrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Value adds up the series of the metric family name whose labels include
// every name/value pair of match (nil matches every series): a counter's or
// a gauge's value, an untyped metric's value. found is false when no series
// matched, so a caller can tell "never exported" from zero.
func Value(tb testing.TB, g prometheus.Gatherer, name string, match map[string]string) (sum float64, found bool) {
	tb.Helper()
	for _, m := range series(tb, g, name, match) {
		found = true
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Untyped != nil:
			sum += m.GetUntyped().GetValue()
		}
	}
	return sum, found
}

// Histogram adds up the sample counts and sums of the histogram name's series
// that match (as Value); a histogram with no matching series is all zero.
func Histogram(tb testing.TB, g prometheus.Gatherer, name string, match map[string]string) (count uint64, sum float64) {
	tb.Helper()
	for _, m := range series(tb, g, name, match) {
		count += m.GetHistogram().GetSampleCount()
		sum += m.GetHistogram().GetSampleSum()
	}
	return count, sum
}

func series(tb testing.TB, g prometheus.Gatherer, name string, match map[string]string) []*dto.Metric {
	tb.Helper()
	families, err := g.Gather()
	if err != nil {
		tb.Fatalf("gathering metrics: %v", err)
	}
	var out []*dto.Metric
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if matches(m, match) {
				out = append(out, m)
			}
		}
	}
	return out
}

func matches(m *dto.Metric, match map[string]string) bool {
	n := 0
	for _, l := range m.GetLabel() {
		if v, ok := match[l.GetName()]; ok {
			if v != l.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(match)
}
