package hotplug

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Registerer is where the queue's metrics go (a prometheus.Registry).
type Registerer = prometheus.Registerer

// metrics are the queue's series. Each carries the backend's name, which a
// backend that detects the host's hotplug path learns only in Run: the
// vectors are registered in New with "backend" as a label, and bind fixes
// it once the name is known, before any series is written.
type metrics struct {
	q      *Queue
	depth  *prometheus.Desc
	oldest *prometheus.Desc
	// wedged counts the intents wedged in KubeVirt by reason, from the
	// same wait bookkeeping as the queue's answers.
	wedged *prometheus.Desc
	vecs   metricVecs
	// backend is the bound name (under q.mu: Collect reads it).
	backend string

	// The series below exist once bind ran; the queue writes them only
	// after that (its workers start, and callers are served, after bind).
	batchSize  prometheus.Observer
	writes     prometheus.Counter
	results    *prometheus.CounterVec
	completion prometheus.ObserverVec
	// held is the part of completion the queue held the change before its
	// last write (gathering a batch, KubeVirt settling the previous one).
	held       prometheus.ObserverVec
	superseded prometheus.Counter
	// hostFailures counts failed attempts at the host, reads included: a host
	// that cannot be reached fails the reads before any change is sent.
	hostFailures *prometheus.CounterVec
	// applyDuration is the latency of the host API calls themselves, apart
	// from the time KubeVirt then takes (completion).
	applyDuration prometheus.Observer
}

// metricVecs are the registered collectors, labelled by backend.
type metricVecs struct {
	batchSize, applyDuration, completion, held *prometheus.HistogramVec
	writes, results, superseded, hostFailures  *prometheus.CounterVec
}

const labelBackend = "backend"

func newMetrics(q *Queue) *metrics {
	with := func(labels ...string) []string { return append([]string{labelBackend}, labels...) }
	return &metrics{
		q: q,
		depth: prometheus.NewDesc("harvester_csi_hotplug_queue_depth",
			"Pending hotplug intents per VM.", with("vm"), nil),
		oldest: prometheus.NewDesc("harvester_csi_hotplug_oldest_intent_age_seconds",
			"Age of the oldest pending hotplug intent per VM.", with("vm"), nil),
		wedged: prometheus.NewDesc("harvester_csi_hotplug_wedged_intents",
			"Hotplug intents wedged in KubeVirt (waiting on a KubeVirt step with no progress for the wedged-after bound), by reason.", with("reason"), nil),
		vecs: metricVecs{
			batchSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name: "harvester_csi_hotplug_batch_size", Help: "Volume changes handed to the backend in one attempt.",
				Buckets: []float64{1, 2, 4, 8, 16, 32, 64},
			}, with()),
			writes: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "harvester_csi_hotplug_vm_writes_total", Help: "Backend attempts that changed a VM's hotplug set.",
			}, with()),
			results: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "harvester_csi_hotplug_change_results_total",
				Help: "Outcomes of volume changes by kind (conflict, in_flight, already_done, rejected, ...).",
			}, with("result")),
			completion: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name: "harvester_csi_hotplug_intent_duration_seconds", Help: "Time from intent to observed completion.",
				Buckets: prometheus.ExponentialBuckets(0.25, 2, 12),
			}, with("op")),
			held: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name:    "harvester_csi_hotplug_intent_held_seconds",
				Help:    "Time from intent to the last write of its change, for intents completed (the rest of intent_duration is KubeVirt's work).",
				Buckets: prometheus.ExponentialBuckets(0.25, 2, 12),
			}, with("op")),
			applyDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name: "harvester_csi_hotplug_apply_duration_seconds", Help: "Time of one backend attempt (the VM patch, or the addvolume/removevolume calls).",
				Buckets: prometheus.ExponentialBuckets(0.01, 2, 12),
			}, with()),
			hostFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "harvester_csi_hotplug_host_failures_total", Help: "Failed attempts at the host API (reads and writes) by cause: refused (403/401), unavailable, other.",
			}, with("cause")),
			superseded: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "harvester_csi_hotplug_intents_superseded_total", Help: "Intents replaced by a newer opposite intent.",
			}, with()),
		},
	}
}

// bind fixes the backend's name on every series. Every result and cause is
// exported from then on at zero: a series born at its first increment is
// invisible to rate() and increase(), so the first rejection or host error
// after a restart would raise no alert.
func (m *metrics) bind(backend string) {
	v, b := m.vecs, prometheus.Labels{labelBackend: backend}
	m.batchSize = v.batchSize.WithLabelValues(backend)
	m.writes = v.writes.WithLabelValues(backend)
	m.results = v.results.MustCurryWith(b)
	m.completion = v.completion.MustCurryWith(b)
	m.held = v.held.MustCurryWith(b)
	m.superseded = v.superseded.WithLabelValues(backend)
	m.hostFailures = v.hostFailures.MustCurryWith(b)
	m.applyDuration = v.applyDuration.WithLabelValues(backend)
	for _, r := range resultNames {
		m.results.WithLabelValues(r)
	}
	for _, cause := range []string{causeRefused, causeUnavailable, causeOther} {
		m.hostFailures.WithLabelValues(cause)
	}
	m.q.mu.Lock()
	m.backend = backend
	m.q.mu.Unlock()
}

func (m *metrics) register(reg Registerer) error {
	v := m.vecs
	for _, c := range []prometheus.Collector{m, v.batchSize, v.writes, v.results, v.completion, v.held, v.superseded, v.applyDuration, v.hostFailures} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// Describe and Collect report the per-VM gauges from the live intent table,
// so they are never stale and cost nothing between scrapes.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- m.depth
	ch <- m.oldest
	ch <- m.wedged
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	q := m.q
	q.mu.Lock()
	defer q.mu.Unlock()
	now := q.now()
	if m.backend != "" {
		// Every reason at zero too: an alert on the gauge sees a wedge
		// begin, and a dashboard sees it end.
		wedged := q.wedgedLocked()
		for _, r := range WedgeReasons() {
			ch <- prometheus.MustNewConstMetric(m.wedged, prometheus.GaugeValue, float64(wedged[r]), m.backend, r)
		}
	}
	for vm, w := range q.work {
		if len(w.intents) == 0 {
			continue
		}
		oldest := now
		for _, it := range w.intents {
			if it.created.Before(oldest) {
				oldest = it.created
			}
		}
		ch <- prometheus.MustNewConstMetric(m.depth, prometheus.GaugeValue, float64(len(w.intents)), m.backend, vm.Name)
		ch <- prometheus.MustNewConstMetric(m.oldest, prometheus.GaugeValue, now.Sub(oldest).Seconds(), m.backend, vm.Name)
	}
}
