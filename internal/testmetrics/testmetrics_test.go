package testmetrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestValueAndHistogram(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total", Help: "c"}, []string{"op", "code"})
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "g", Help: "g"}, []string{"reason"})
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "h_seconds", Help: "h"}, []string{"op"})
	reg.MustRegister(c, g, h)
	c.WithLabelValues("attach", "ok").Add(2)
	c.WithLabelValues("attach", "fail").Add(3)
	c.WithLabelValues("detach", "ok").Add(5)
	g.WithLabelValues("kubevirt").Set(4)
	h.WithLabelValues("attach").Observe(1.5)
	h.WithLabelValues("detach").Observe(2)
	h.WithLabelValues("detach").Observe(3)

	for _, tc := range []struct {
		name  string
		match map[string]string
		want  float64
		found bool
	}{
		{"c_total", nil, 10, true},
		{"c_total", map[string]string{"op": "attach"}, 5, true},
		{"c_total", map[string]string{"op": "attach", "code": "ok"}, 2, true},
		{"c_total", map[string]string{"op": "resize"}, 0, false},
		{"c_total", map[string]string{"zone": "a"}, 0, false},
		{"g", map[string]string{"reason": "kubevirt"}, 4, true},
		{"g", map[string]string{"reason": "host"}, 0, false},
		{"missing", nil, 0, false},
	} {
		got, found := Value(t, reg, tc.name, tc.match)
		if got != tc.want || found != tc.found {
			t.Errorf("Value(%s, %v) = %v, %v; want %v, %v", tc.name, tc.match, got, found, tc.want, tc.found)
		}
	}
	if n, s := Histogram(t, reg, "h_seconds", map[string]string{"op": "detach"}); n != 2 || s != 5 {
		t.Errorf("detach histogram = %d, %v; want 2, 5", n, s)
	}
	if n, s := Histogram(t, reg, "h_seconds", nil); n != 3 || s != 6.5 {
		t.Errorf("whole histogram = %d, %v; want 3, 6.5", n, s)
	}
}
