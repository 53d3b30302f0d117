package subscribers

import (
	"context"
	"log/slog"
	"time"

	"github.com/fanout/fanout/internal/metrics"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics is the Observer that exports the subscriber runtime's
// Prometheus metrics, labelled by subscriber (a decorator: the runtime
// itself counts nothing).
type Metrics struct {
	NopObserver
	handled, skipped, retried, dead *prometheus.CounterVec
	seconds                         *prometheus.HistogramVec
	dependencyUp                    *prometheus.GaugeVec
	outages, outageSeconds          *prometheus.CounterVec
	stalled                         *prometheus.GaugeVec
	configDifferences               *prometheus.GaugeVec
	deadLetterShareUsed             *prometheus.GaugeVec
	deadLetterShareLimit            *prometheus.GaugeVec
	stages                          *metrics.StageRecorder
}

var _ Observer = (*Metrics)(nil)

// NewMetrics registers the subscriber runtime's metrics.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	c := func(name, help string) *prometheus.CounterVec {
		m := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "subscriber", Name: name, Help: help}, []string{"subscriber"})
		reg.MustRegister(m)
		return m
	}
	m := &Metrics{
		handled: c("handled_events_total", "Events whose effect happened (and was checkpointed)."),
		skipped: c("skipped_duplicates_total", "Events already in the checkpoint: redeliveries and duplicate publishes absorbed."),
		retried: c("retried_events_total", "Events naked for a later redelivery."),
		dead:    c("dead_lettered_events_total", "Events sent to the dead letters."),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "batch_seconds",
			Help: "Time to handle one batch, checkpoint included.", Buckets: metrics.LatencyBuckets}, []string{"subscriber"}),
		stages: metrics.StagesOf(reg),
	}
	m.dependencyUp = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "dependency_up",
		Help: "1 while the subscriber's dependency answers, 0 while it is down (the subscriber then holds its events and takes no new ones)."},
		[]string{"subscriber", "dependency"})
	m.outages = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "dependency_outages_total",
		Help: "Times a dependency of the subscriber went down."}, []string{"subscriber", "dependency"})
	m.outageSeconds = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "dependency_outage_seconds_total",
		Help: "Time the subscriber spent waiting for a dependency that was down (counted when it comes back)."}, []string{"subscriber", "dependency"})
	m.stalled = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "stalled",
		Help: "1 while the subscriber is stalled: events wait and it settled none for subscribers.stall_after (it is not ready, and logs why)."},
		[]string{"subscriber"})
	m.configDifferences = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "config_differences",
		Help: "Settings of a live stream or of the subscriber's consumer (object) that differ from fanout's configuration, as of the last check (stream.check_interval): anything above 0 makes the subscriber not ready."},
		[]string{"subscriber", "object"})
	m.deadLetterShareUsed = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "deadletter_share_used_bytes",
		Help: "Bytes the dead letters' account uses of its share of the store (subscribers.dead_letter_api_prefix), as this subscriber last read it."}, []string{"subscriber"})
	m.deadLetterShareLimit = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "deadletter_share_limit_bytes",
		Help: "The dead letters' share of the store (-1: no limit); at it, every subscriber's dead letters are refused."}, []string{"subscriber"})
	reg.MustRegister(m.seconds, m.dependencyUp, m.outages, m.outageSeconds, m.stalled, m.configDifferences, m.deadLetterShareUsed, m.deadLetterShareLimit)
	return m
}

func (m *Metrics) Handled(s string, n int, took time.Duration) {
	m.handled.WithLabelValues(s).Add(float64(n))
	m.seconds.WithLabelValues(s).Observe(took.Seconds())
}
func (m *Metrics) Skipped(s string, n int)      { m.skipped.WithLabelValues(s).Add(float64(n)) }
func (m *Metrics) Retried(s string, n int)      { m.retried.WithLabelValues(s).Add(float64(n)) }
func (m *Metrics) DeadLettered(s string, n int) { m.dead.WithLabelValues(s).Add(float64(n)) }

func (m *Metrics) DependencyDown(s, dep string) {
	m.dependencyUp.WithLabelValues(s, dep).Set(0)
	m.outages.WithLabelValues(s, dep).Inc()
}

func (m *Metrics) DependencyUp(s, dep string, down time.Duration) {
	m.dependencyUp.WithLabelValues(s, dep).Set(1)
	m.outageSeconds.WithLabelValues(s, dep).Add(down.Seconds())
}

func (m *Metrics) DeadLetterShare(s string, used, limit int64) {
	m.deadLetterShareUsed.WithLabelValues(s).Set(float64(used))
	m.deadLetterShareLimit.WithLabelValues(s).Set(float64(limit))
}

func (m *Metrics) ConfigDifferences(s, object string, n int) {
	m.configDifferences.WithLabelValues(s, object).Set(float64(n))
}

func (m *Metrics) Stalled(s string, stalled bool) {
	v := 0.0
	if stalled {
		v = 1
	}
	m.stalled.WithLabelValues(s).Set(v)
}

func (m *Metrics) Timed(s string, evs []EventTimes) {
	delivered := make([]time.Duration, 0, len(evs))
	handled := make([]time.Duration, 0, len(evs))
	for _, e := range evs {
		if !e.Stored.IsZero() && !e.Delivered.IsZero() {
			delivered = append(delivered, e.Delivered.Sub(e.Stored))
		}
		if !e.Delivered.IsZero() {
			handled = append(handled, e.Handled.Sub(e.Delivered))
		}
	}
	m.stages.Observe(metrics.StageDelivered, s, delivered...)
	m.stages.Observe(metrics.StageHandled, s, handled...)
}

// consumerCollector reads each subscriber's consumer state when scraped
// (at most every metrics.ScrapeFresh).
type consumerCollector struct {
	js                           jetstream.JetStream
	stream                       string
	names                        []string
	logger                       *slog.Logger
	pending, ackPending, redeliv *prometheus.Desc
}

// NewConsumerCollector reports, per subscriber, its consumer's pending
// (lag), ack-pending and redelivered counts, read at most every
// metrics.ScrapeFresh.
func NewConsumerCollector(js jetstream.JetStream, stream string, names []string, logger *slog.Logger) prometheus.Collector {
	l := []string{"subscriber"}
	return metrics.Cached(&consumerCollector{
		js: js, stream: stream, names: names, logger: logger,
		pending:    prometheus.NewDesc("fanout_subscriber_pending_events", "Events in the stream the subscriber has not received yet (its lag).", l, nil),
		ackPending: prometheus.NewDesc("fanout_subscriber_ack_pending_events", "Events delivered to the subscriber and not acknowledged yet.", l, nil),
		redeliv:    prometheus.NewDesc("fanout_subscriber_redelivered_events", "Events delivered more than once and not acknowledged yet.", l, nil),
	}, metrics.ScrapeFresh)
}

func (c *consumerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.ackPending
	ch <- c.redeliv
}

func (c *consumerCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), metrics.ScrapeTimeout)
	defer cancel()
	for _, name := range c.names {
		cons, err := c.js.Consumer(ctx, c.stream, name)
		if err != nil {
			c.logger.Warn("metrics: consumer info", "subscriber", name, "error", err)
			continue
		}
		info, err := cons.Info(ctx)
		if err != nil {
			c.logger.Warn("metrics: consumer info", "subscriber", name, "error", err)
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(info.NumPending), name)
		ch <- prometheus.MustNewConstMetric(c.ackPending, prometheus.GaugeValue, float64(info.NumAckPending), name)
		ch <- prometheus.MustNewConstMetric(c.redeliv, prometheus.GaugeValue, float64(info.NumRedelivered), name)
	}
}

// NewHeldAggregatesCollector reports, for each ordered subscriber in
// names, how many of its aggregates are held behind a dead-lettered event
// (subscribers.on_dead_letter hold): each waits for an operator. Read at
// most every metrics.ScrapeFresh.
func NewHeldAggregatesCollector(pool *pgxpool.Pool, names []string, logger *slog.Logger) prometheus.Collector {
	return metrics.Cached(&heldAggregatesCollector{pool: pool, names: names, logger: logger,
		held: prometheus.NewDesc("fanout_subscriber_held_aggregates",
			"Aggregates an ordered subscriber holds behind a dead-lettered event (subscribers.on_dead_letter hold).", []string{"subscriber"}, nil)},
		metrics.ScrapeFresh)
}

type heldAggregatesCollector struct {
	pool   *pgxpool.Pool
	names  []string
	logger *slog.Logger
	held   *prometheus.Desc
}

func (c *heldAggregatesCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.held }

func (c *heldAggregatesCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), metrics.ScrapeTimeout)
	defer cancel()
	counts, err := CountHeldAggregates(ctx, c.pool)
	if err != nil {
		c.logger.Warn("metrics: count held aggregates", "error", err)
		return
	}
	for _, name := range c.names {
		ch <- prometheus.MustNewConstMetric(c.held, prometheus.GaugeValue, float64(counts[name]), name)
	}
}
