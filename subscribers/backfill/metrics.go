package backfill

import "github.com/prometheus/client_golang/prometheus"

// Metrics are a backfill's gauges, set from its progress.
type Metrics struct {
	total, done, failed, paused *prometheus.GaugeVec
}

// NewMetrics registers the backfill gauges on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	gauge := func(name, help string) *prometheus.GaugeVec {
		g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "subscriber", Name: name, Help: help}, []string{"subscriber"})
		reg.MustRegister(g)
		return g
	}
	return &Metrics{
		total:  gauge("backfill_rows", "Rows the subscriber's backfill has to handle (as counted when it started)."),
		done:   gauge("backfill_rows_done", "Rows the subscriber's backfill has handled."),
		failed: gauge("backfill_rows_failed", "Rows the subscriber's backfill could not apply (subscriber_backfill_failures)."),
		paused: gauge("backfill_paused", "1 while the subscriber's backfill is paused."),
	}
}

// Observe sets the gauges from s.
func (m *Metrics) Observe(s Status) {
	m.total.WithLabelValues(s.Subscriber).Set(float64(s.Total))
	m.done.WithLabelValues(s.Subscriber).Set(float64(s.Done))
	m.failed.WithLabelValues(s.Subscriber).Set(float64(s.Failed))
	p := 0.0
	if s.Paused {
		p = 1
	}
	m.paused.WithLabelValues(s.Subscriber).Set(p)
}
