package hotplug

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Registerer is where the queue's metrics go (a prometheus.Registry).
type Registerer = prometheus.Registerer

type metrics struct {
	q          *Queue
	depth      *prometheus.Desc
	oldest     *prometheus.Desc
	batchSize  prometheus.Histogram
	writes     prometheus.Counter
	results    *prometheus.CounterVec
	completion *prometheus.HistogramVec
	// held is the part of completion the queue held the change before its
	// last write (gathering a batch, KubeVirt settling the previous one).
	held       *prometheus.HistogramVec
	superseded prometheus.Counter
	// hostFailures counts failed attempts at the host, reads included: a host
	// that cannot be reached fails the reads before any change is sent.
	hostFailures *prometheus.CounterVec
	// applyDuration is the latency of the host API calls themselves, apart
	// from the time KubeVirt then takes (completion).
	applyDuration prometheus.Histogram
}

func newMetrics(q *Queue, backend string) *metrics {
	constLabels := prometheus.Labels{"backend": backend}
	m := &metrics{
		q: q,
		depth: prometheus.NewDesc("harvester_csi_hotplug_queue_depth",
			"Pending hotplug intents per VM.", []string{"vm"}, constLabels),
		oldest: prometheus.NewDesc("harvester_csi_hotplug_oldest_intent_age_seconds",
			"Age of the oldest pending hotplug intent per VM.", []string{"vm"}, constLabels),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "harvester_csi_hotplug_batch_size", Help: "Volume changes handed to the backend in one attempt.",
			ConstLabels: constLabels, Buckets: []float64{1, 2, 4, 8, 16, 32, 64},
		}),
		writes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "harvester_csi_hotplug_vm_writes_total", Help: "Backend attempts that changed a VM's hotplug set.",
			ConstLabels: constLabels,
		}),
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "harvester_csi_hotplug_change_results_total",
			Help: "Outcomes of volume changes by kind (conflict, in_flight, already_done, rejected, ...).", ConstLabels: constLabels,
		}, []string{"result"}),
		completion: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "harvester_csi_hotplug_intent_duration_seconds", Help: "Time from intent to observed completion.",
			ConstLabels: constLabels, Buckets: prometheus.ExponentialBuckets(0.25, 2, 12),
		}, []string{"op"}),
		held: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "harvester_csi_hotplug_intent_held_seconds",
			Help:        "Time from intent to the last write of its change, for intents completed (the rest of intent_duration is KubeVirt's work).",
			ConstLabels: constLabels, Buckets: prometheus.ExponentialBuckets(0.25, 2, 12),
		}, []string{"op"}),
		applyDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "harvester_csi_hotplug_apply_duration_seconds", Help: "Time of one backend attempt (the VM patch, or the addvolume/removevolume calls).",
			ConstLabels: constLabels, Buckets: prometheus.ExponentialBuckets(0.01, 2, 12),
		}),
		hostFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "harvester_csi_hotplug_host_failures_total", Help: "Failed attempts at the host API (reads and writes) by cause: refused (403/401), unavailable, other.",
			ConstLabels: constLabels,
		}, []string{"cause"}),
		superseded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "harvester_csi_hotplug_intents_superseded_total", Help: "Intents replaced by a newer opposite intent.",
			ConstLabels: constLabels,
		}),
	}
	// Every result is exported from the start at zero: a series born at its
	// first increment is invisible to rate() and increase(), so the first
	// rejection or host error after a restart would raise no alert.
	for _, r := range resultNames {
		m.results.WithLabelValues(r)
	}
	return m
}

func (m *metrics) register(reg Registerer) error {
	for _, cause := range []string{causeRefused, causeUnavailable, causeOther} {
		m.hostFailures.WithLabelValues(cause)
	}
	for _, c := range []prometheus.Collector{m, m.batchSize, m.writes, m.results, m.completion, m.held, m.superseded, m.applyDuration, m.hostFailures} {
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
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	q := m.q
	q.mu.Lock()
	defer q.mu.Unlock()
	now := q.now()
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
		ch <- prometheus.MustNewConstMetric(m.depth, prometheus.GaugeValue, float64(len(w.intents)), vm.Name)
		ch <- prometheus.MustNewConstMetric(m.oldest, prometheus.GaugeValue, now.Sub(oldest).Seconds(), vm.Name)
	}
}
