package main

import (
	"context"
	"net/url"
	"runtime"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientmetrics "k8s.io/client-go/tools/metrics"
)

// buildInfo is the constant series an operator joins other series with to
// see which build runs where.
func buildInfo(version, commit string) prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "harvester_csi_build_info",
		Help: "Always 1; the labels name the running build.",
	}, []string{"version", "commit", "go_version"})
	g.WithLabelValues(version, commit, runtime.Version()).Set(1)
	return g
}

// apiRequests counts the driver's requests to the host and guest API servers
// by verb and answer, and times them: client-go reports every request of
// every client in the process through one hook, and the request's server
// tells which cluster it went to.
type apiRequests struct {
	hostServer string // host:port of the host kubeconfig's server ("" unknown)
	results    *prometheus.CounterVec
	latency    *prometheus.HistogramVec
}

func newAPIRequests(hostServer string) *apiRequests {
	return &apiRequests{
		hostServer: hostServer,
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "harvester_csi_api_requests_total",
			Help: "Requests of the driver to the host (Harvester) and guest API servers, by cluster, verb and HTTP code (\"<error>\": no answer).",
		}, []string{"cluster", "verb", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "harvester_csi_api_request_duration_seconds",
			Help:    "Latency of the driver's requests to the host and guest API servers, by cluster and verb.",
			Buckets: []float64{0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30},
		}, []string{"cluster", "verb"}),
	}
}

func (a *apiRequests) cluster(server string) string {
	if a.hostServer != "" && server == a.hostServer {
		return "host"
	}
	return "guest"
}

// Increment implements client-go's ResultMetric.
func (a *apiRequests) Increment(_ context.Context, code, method, server string) {
	a.results.WithLabelValues(a.cluster(server), strings.ToUpper(method), code).Inc()
}

// Observe implements client-go's LatencyMetric.
func (a *apiRequests) Observe(_ context.Context, verb string, u url.URL, latency time.Duration) {
	a.latency.WithLabelValues(a.cluster(u.Host), strings.ToUpper(verb)).Observe(latency.Seconds())
}

func (a *apiRequests) Describe(ch chan<- *prometheus.Desc) {
	a.results.Describe(ch)
	a.latency.Describe(ch)
}

func (a *apiRequests) Collect(ch chan<- prometheus.Metric) {
	a.results.Collect(ch)
	a.latency.Collect(ch)
}

// registerAPIRequests hands client-go the request hooks. client-go takes
// them once per process (its own sync.Once), so this runs from main only.
func registerAPIRequests(reg prometheus.Registerer, hostServer string) error {
	a := newAPIRequests(hostServer)
	if err := reg.Register(a); err != nil {
		return err
	}
	clientmetrics.Register(clientmetrics.RegisterOpts{RequestResult: a, RequestLatency: a})
	return nil
}

// serverHostPort is the host:port part of a rest.Config's Host, as client-go
// reports it with each request.
func serverHostPort(server string) string {
	u, err := url.Parse(server)
	if err != nil || u.Host == "" {
		return server
	}
	return u.Host
}

// tokenExpiry exports when the host credentials' token expires, so an alert
// can warn well before every hotplug starts failing with Unauthorized. The
// series is absent when the credentials do not say (no token, or one without
// an expiry).
type tokenExpiry struct {
	expiry func() (time.Time, bool)
	desc   *prometheus.Desc
}

func newTokenExpiry(expiry func() (time.Time, bool)) *tokenExpiry {
	return &tokenExpiry{expiry: expiry, desc: prometheus.NewDesc("harvester_csi_host_token_expiry_timestamp_seconds",
		"When the token of the host (Harvester) kubeconfig expires, as Unix time; read again when the kubeconfig changes.", nil, nil)}
}

func (t *tokenExpiry) Describe(ch chan<- *prometheus.Desc) { ch <- t.desc }

func (t *tokenExpiry) Collect(ch chan<- prometheus.Metric) {
	if at, ok := t.expiry(); ok {
		ch <- prometheus.MustNewConstMetric(t.desc, prometheus.GaugeValue, float64(at.Unix()))
	}
}
