// Package metrics exposes fanout's Prometheus metrics. The relay and the
// subscriber runtime report through small observer interfaces; the types
// here implement them (decorators, not counters sprinkled through the
// code), and collectors read gauges (backlog, consumer lag) from Postgres
// and JetStream when Prometheus scrapes.
package metrics

import (
	"context"
	"log/slog"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// NewRegistry returns a registry with the Go runtime and process metrics.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// latencyBuckets span 1 ms to about 30 s.
var latencyBuckets = prometheus.ExponentialBuckets(0.001, 2, 16)

// Relay implements relay.Observer. It embeds the no-op observer, so a
// method added to the interface compiles before it is measured.
type Relay struct {
	relay.NopObserver
	claimed, published, duplicates, retried, failed, reaped, deleted prometheus.Counter
	claimSeconds                                                     prometheus.Histogram
	stages                                                           *StageRecorder
	slotLagBytes, slotStuckSeconds                                   prometheus.Gauge
	outboxRanges                                                     prometheus.Gauge
	outboxRangesDropped                                              prometheus.Counter
}

var _ relay.Observer = (*Relay)(nil)

// NewRelay registers the relay's metrics.
func NewRelay(reg prometheus.Registerer) *Relay {
	c := func(name, help string) prometheus.Counter {
		m := prometheus.NewCounter(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "relay", Name: name, Help: help})
		reg.MustRegister(m)
		return m
	}
	m := &Relay{
		claimed:             c("claimed_rows_total", "Outbox rows claimed for publishing."),
		published:           c("published_rows_total", "Outbox rows whose PubAck arrived and that were marked sent."),
		duplicates:          c("duplicate_publishes_total", "Publishes JetStream recognized as duplicates (a row published again after a crash or a lost lease)."),
		retried:             c("retried_rows_total", "Rows returned to pending after a failed publish."),
		failed:              c("failed_rows_total", "Rows marked failed: they can never be published."),
		reaped:              c("reaped_rows_total", "Rows whose lease expired, returned to pending."),
		deleted:             c("deleted_rows_total", "Rows of outbox_default (no range of the outbox holds them) deleted after their retention."),
		outboxRangesDropped: c("outbox_ranges_dropped_total", "Ranges (partitions) of the outbox dropped after their retention."),
		outboxRanges: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "relay", Name: "outbox_ranges",
			Help: "Ranges (partitions) the outbox holds, as of the last retention pass."}),
		claimSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "fanout", Subsystem: "relay", Name: "claim_seconds",
			Help: "Time to claim one batch.", Buckets: latencyBuckets}),
		stages: StagesOf(reg),
		slotLagBytes: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "relay", Name: "slot_lag_bytes",
			Help: "relay.capture wal: how far the replication slot's confirmed position is behind the server's WAL (the WAL the server keeps for it)."}),
		slotStuckSeconds: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "relay", Name: "slot_lag_seconds",
			Help: "relay.capture wal: how long the replication slot has been behind without its confirmed position moving (0 when it is not behind)."}),
	}
	reg.MustRegister(m.claimSeconds, m.slotLagBytes, m.slotStuckSeconds, m.outboxRanges)
	return m
}

func (m *Relay) Claimed(n int, took time.Duration) {
	m.claimed.Add(float64(n))
	m.claimSeconds.Observe(took.Seconds())
}

func (m *Relay) Published(evs []relay.Published) {
	m.published.Add(float64(len(evs)))
	took := make([]time.Duration, len(evs))
	for i, e := range evs {
		if e.Duplicate {
			m.duplicates.Inc()
		}
		took[i] = e.AckedAt.Sub(e.CreatedAt)
	}
	m.stages.Observe(StagePublished, "", took...)
}

func (m *Relay) Retried(n int) { m.retried.Add(float64(n)) }
func (m *Relay) Failed(n int)  { m.failed.Add(float64(n)) }
func (m *Relay) Reaped(n int)  { m.reaped.Add(float64(n)) }
func (m *Relay) Deleted(n int) { m.deleted.Add(float64(n)) }

func (m *Relay) OutboxRanges(held, dropped int) {
	m.outboxRanges.Set(float64(held))
	m.outboxRangesDropped.Add(float64(dropped))
}

func (m *Relay) SlotLag(bytes int64, stuck time.Duration) {
	m.slotLagBytes.Set(float64(bytes))
	m.slotStuckSeconds.Set(stuck.Seconds())
}

// Subscribers implements subscribers.Observer.
type Subscribers struct {
	subscribers.NopObserver
	handled, skipped, retried, dead *prometheus.CounterVec
	seconds                         *prometheus.HistogramVec
	dependencyUp                    *prometheus.GaugeVec
	outages, outageSeconds          *prometheus.CounterVec
	stalled                         *prometheus.GaugeVec
	stages                          *StageRecorder
}

var _ subscribers.Observer = (*Subscribers)(nil)

// NewSubscribers registers the subscriber runtime's metrics.
func NewSubscribers(reg prometheus.Registerer) *Subscribers {
	c := func(name, help string) *prometheus.CounterVec {
		m := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "subscriber", Name: name, Help: help}, []string{"subscriber"})
		reg.MustRegister(m)
		return m
	}
	m := &Subscribers{
		handled: c("handled_events_total", "Events whose effect happened (and was checkpointed)."),
		skipped: c("skipped_duplicates_total", "Events already in the checkpoint: redeliveries and duplicate publishes absorbed."),
		retried: c("retried_events_total", "Events naked for a later redelivery."),
		dead:    c("dead_lettered_events_total", "Events sent to the dead letters."),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "fanout", Subsystem: "subscriber", Name: "batch_seconds",
			Help: "Time to handle one batch, checkpoint included.", Buckets: latencyBuckets}, []string{"subscriber"}),
		stages: StagesOf(reg),
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
	reg.MustRegister(m.seconds, m.dependencyUp, m.outages, m.outageSeconds, m.stalled)
	return m
}

func (m *Subscribers) Handled(s string, n int, took time.Duration) {
	m.handled.WithLabelValues(s).Add(float64(n))
	m.seconds.WithLabelValues(s).Observe(took.Seconds())
}
func (m *Subscribers) Skipped(s string, n int)      { m.skipped.WithLabelValues(s).Add(float64(n)) }
func (m *Subscribers) Retried(s string, n int)      { m.retried.WithLabelValues(s).Add(float64(n)) }
func (m *Subscribers) DeadLettered(s string, n int) { m.dead.WithLabelValues(s).Add(float64(n)) }

func (m *Subscribers) DependencyDown(s, dep string) {
	m.dependencyUp.WithLabelValues(s, dep).Set(0)
	m.outages.WithLabelValues(s, dep).Inc()
}

func (m *Subscribers) DependencyUp(s, dep string, down time.Duration) {
	m.dependencyUp.WithLabelValues(s, dep).Set(1)
	m.outageSeconds.WithLabelValues(s, dep).Add(down.Seconds())
}

func (m *Subscribers) Stalled(s string, stalled bool) {
	v := 0.0
	if stalled {
		v = 1
	}
	m.stalled.WithLabelValues(s).Set(v)
}

func (m *Subscribers) Timed(s string, evs []subscribers.EventTimes) {
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
	m.stages.Observe(StageDelivered, s, delivered...)
	m.stages.Observe(StageHandled, s, handled...)
}

// BulkItems counts search bulk item outcomes (ok, conflict, not_found,
// retry, failed, rejected: see searchindex.Handler.ObserveBulkItems).
type BulkItems struct{ items *prometheus.CounterVec }

// NewBulkItems registers the search indexer's bulk metrics.
func NewBulkItems(reg prometheus.Registerer) *BulkItems {
	m := &BulkItems{items: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "search",
		Name: "bulk_items_total", Help: "Search bulk items by outcome."}, []string{"outcome"})}
	reg.MustRegister(m.items)
	return m
}

// BulkItem counts one item.
func (m *BulkItems) BulkItem(outcome string) { m.items.WithLabelValues(outcome).Inc() }

// scrapeTimeout bounds the queries a scrape runs.
const scrapeTimeout = 3 * time.Second

// outboxCollector reads the backlog from Postgres on each scrape.
type outboxCollector struct {
	store                   *outbox.Store
	logger                  *slog.Logger
	backlog, oldest, failed *prometheus.Desc
	held                    *prometheus.Desc
}

// NewOutboxCollector reports the outbox backlog (pending and sending rows),
// the age of the oldest pending row, failed rows, and the events they hold
// back under the relays' onFailed (relay.on_failed).
func NewOutboxCollector(pool *pgxpool.Pool, onFailed string, logger *slog.Logger) prometheus.Collector {
	store := outbox.NewStore(pool)
	store.OnFailed = outbox.OnFailed(onFailed)
	return &outboxCollector{
		store: store, logger: logger,
		backlog: prometheus.NewDesc("fanout_outbox_backlog_rows", "Outbox rows not yet published (pending or sending).", nil, nil),
		oldest:  prometheus.NewDesc("fanout_outbox_oldest_pending_age_seconds", "Age of the oldest pending outbox row (0 if none).", nil, nil),
		failed:  prometheus.NewDesc("fanout_outbox_failed_rows", "Outbox rows marked failed.", nil, nil),
		held: prometheus.NewDesc("fanout_relay_outbox_held_rows",
			"Outbox events held behind a failed earlier event of their aggregate (relay.on_failed hold).", nil, nil),
	}
}

func (c *outboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.backlog
	ch <- c.oldest
	ch <- c.failed
	ch <- c.held
}

func (c *outboxCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()
	b, err := c.store.Backlog(ctx)
	if err != nil {
		c.logger.Warn("metrics: read outbox state", "error", err)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.backlog, prometheus.GaugeValue, float64(b.Pending+b.Sending))
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, b.OldestPending.Seconds())
	ch <- prometheus.MustNewConstMetric(c.failed, prometheus.GaugeValue, float64(b.Failed))
	var held int64
	if b.Failed > 0 {
		if held, _, err = c.store.Held(ctx); err != nil {
			c.logger.Warn("metrics: read the events held behind failed ones", "error", err)
			return
		}
	}
	ch <- prometheus.MustNewConstMetric(c.held, prometheus.GaugeValue, float64(held))
}

// consumerCollector reads each subscriber's consumer state on each scrape.
type consumerCollector struct {
	js                           jetstream.JetStream
	stream                       string
	names                        []string
	logger                       *slog.Logger
	pending, ackPending, redeliv *prometheus.Desc
}

// NewConsumerCollector reports, per subscriber, its consumer's pending
// (lag), ack-pending and redelivered counts.
func NewConsumerCollector(js jetstream.JetStream, stream string, names []string, logger *slog.Logger) prometheus.Collector {
	l := []string{"subscriber"}
	return &consumerCollector{
		js: js, stream: stream, names: names, logger: logger,
		pending:    prometheus.NewDesc("fanout_subscriber_pending_events", "Events in the stream the subscriber has not received yet (its lag).", l, nil),
		ackPending: prometheus.NewDesc("fanout_subscriber_ack_pending_events", "Events delivered to the subscriber and not acknowledged yet.", l, nil),
		redeliv:    prometheus.NewDesc("fanout_subscriber_redelivered_events", "Events delivered more than once and not acknowledged yet.", l, nil),
	}
}

func (c *consumerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.ackPending
	ch <- c.redeliv
}

func (c *consumerCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
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
// (subscribers.on_dead_letter hold): each waits for an operator.
func NewHeldAggregatesCollector(pool *pgxpool.Pool, names []string, logger *slog.Logger) prometheus.Collector {
	return &heldAggregatesCollector{pool: pool, names: names, logger: logger,
		held: prometheus.NewDesc("fanout_subscriber_held_aggregates",
			"Aggregates an ordered subscriber holds behind a dead-lettered event (subscribers.on_dead_letter hold).", []string{"subscriber"}, nil)}
}

type heldAggregatesCollector struct {
	pool   *pgxpool.Pool
	names  []string
	logger *slog.Logger
	held   *prometheus.Desc
}

func (c *heldAggregatesCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.held }

func (c *heldAggregatesCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()
	counts, err := subscribers.CountHeldAggregates(ctx, c.pool)
	if err != nil {
		c.logger.Warn("metrics: count held aggregates", "error", err)
		return
	}
	for _, name := range c.names {
		ch <- prometheus.MustNewConstMetric(c.held, prometheus.GaugeValue, float64(counts[name]), name)
	}
}
