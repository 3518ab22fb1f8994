package main

import (
	"context"
	"net/url"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Requests are counted per cluster: the host's server as the host
// kubeconfig names it, everything else as the guest.
func TestAPIRequestsByCluster(t *testing.T) {
	a := newAPIRequests(serverHostPort("https://harvester.example:6443"))
	ctx := context.Background()
	a.Increment(ctx, "200", "get", "harvester.example:6443")
	a.Increment(ctx, "200", "GET", "harvester.example:6443")
	a.Increment(ctx, "403", "patch", "harvester.example:6443")
	a.Increment(ctx, "200", "get", "10.43.0.1:443")
	a.Observe(ctx, "get", url.URL{Host: "harvester.example:6443"}, 30*time.Millisecond)
	for _, c := range []struct {
		cluster, verb, code string
		want                float64
	}{{"host", "GET", "200", 2}, {"host", "PATCH", "403", 1}, {"guest", "GET", "200", 1}} {
		if got := testutil.ToFloat64(a.results.WithLabelValues(c.cluster, c.verb, c.code)); got != c.want {
			t.Errorf("%s %s %s: %v requests, want %v", c.cluster, c.verb, c.code, got, c.want)
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(a, buildInfo("v1.2.3", "abc123"))
	want := `
# HELP harvester_csi_build_info Always 1; the labels name the running build.
# TYPE harvester_csi_build_info gauge
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want+buildInfoLine()), "harvester_csi_build_info"); err != nil {
		t.Error(err)
	}
	if n, err := testutil.GatherAndCount(reg, "harvester_csi_api_request_duration_seconds"); err != nil || n != 1 {
		t.Errorf("latency series: %d, %v", n, err)
	}
}

func buildInfoLine() string {
	return `harvester_csi_build_info{commit="abc123",go_version="` + goVersion() + `",version="v1.2.3"} 1
`
}

func goVersion() string { return runtime.Version() }

// The token's expiry is exported only while the credentials say it.
func TestTokenExpirySeries(t *testing.T) {
	var at time.Time
	reg := prometheus.NewRegistry()
	reg.MustRegister(newTokenExpiry(func() (time.Time, bool) { return at, !at.IsZero() }))
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 0 {
		t.Errorf("a token without expiry exports %d series (%v)", n, err)
	}
	at = time.Unix(1893456000, 0)
	want := `# HELP harvester_csi_host_token_expiry_timestamp_seconds When the token of the host (Harvester) kubeconfig expires, as Unix time; read again when the kubeconfig changes.
# TYPE harvester_csi_host_token_expiry_timestamp_seconds gauge
harvester_csi_host_token_expiry_timestamp_seconds 1.893456e+09
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Error(err)
	}
}
