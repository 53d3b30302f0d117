package relay

import (
	"context"
	"log/slog"
	"time"

	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics is the Observer that exports the relay's Prometheus metrics (a
// decorator: the relay itself counts nothing). It embeds the no-op
// observer, so a method added to the interface compiles before it is
// measured.
type Metrics struct {
	NopObserver
	claimed, published, duplicates, retried, failed, reaped, deleted prometheus.Counter
	claimSeconds                                                     prometheus.Histogram
	stages                                                           *metrics.StageRecorder
	slotLagBytes, slotStuckSeconds                                   prometheus.Gauge
	outboxRanges                                                     prometheus.Gauge
	outboxRangesDropped                                              prometheus.Counter
	configDifferences                                                *prometheus.GaugeVec
	rewinds                                                          prometheus.Counter
	auditChecked, auditMissing, auditRepaired, auditAltered          *prometheus.CounterVec
	atomicBatches, atomicEvents                                      *prometheus.CounterVec
}

var _ Observer = (*Metrics)(nil)

// NewMetrics registers the relay's metrics.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	c := func(name, help string) prometheus.Counter {
		m := prometheus.NewCounter(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "relay", Name: name, Help: help})
		reg.MustRegister(m)
		return m
	}
	m := &Metrics{
		claimed:             c("claimed_rows_total", "Outbox rows claimed for publishing."),
		published:           c("published_rows_total", "Outbox rows whose PubAck arrived and that were marked sent."),
		duplicates:          c("duplicate_publishes_total", "Publishes JetStream recognized as duplicates (a row published again after a crash or a lost lease)."),
		retried:             c("retried_rows_total", "Rows returned to pending after a failed publish."),
		failed:              c("failed_rows_total", "Rows marked failed: they can never be published."),
		reaped:              c("reaped_rows_total", "Rows whose lease expired, returned to pending."),
		deleted:             c("deleted_rows_total", "Rows of outbox_default (no range of the outbox holds them) deleted after their retention."),
		rewinds:             c("rewinds_total", "Restores found to have rewound the outbox's ids: each began a new outbox epoch (see the relay's ERROR log)."),
		outboxRangesDropped: c("outbox_ranges_dropped_total", "Ranges (partitions) of the outbox dropped after their retention."),
		outboxRanges: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "relay", Name: "outbox_ranges",
			Help: "Ranges (partitions) the outbox holds, as of the last retention pass."}),
		claimSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "fanout", Subsystem: "relay", Name: "claim_seconds",
			Help: "Time to claim one batch.", Buckets: metrics.LatencyBuckets}),
		stages: metrics.StagesOf(reg),
		slotLagBytes: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "relay", Name: "slot_lag_bytes",
			Help: "relay.capture wal: how far the replication slot's confirmed position is behind the server's WAL (the WAL the server keeps for it)."}),
		slotStuckSeconds: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "relay", Name: "slot_lag_seconds",
			Help: "relay.capture wal: how long the replication slot has been behind without its confirmed position moving (0 when it is not behind)."}),
	}
	m.configDifferences = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "relay", Name: "config_differences",
		Help: "Settings of the live stream (object \"stream <name>\") that differ from fanout's configuration, and marks of a consumer of it turned against another (object \"consumer <name> of stream <name>\": a delivery subject into the server's API or the stream's subjects, a position past the stream's last message), as of the last check (stream.check_interval): anything above 0 makes the relay not ready."}, []string{"object"})
	cv := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "relay", Name: name, Help: help}, []string{"kind"})
	}
	m.auditChecked = cv("audit_checked_total", "Published events the auditor checked against the stream, by kind of audit (tail, lookback, range, command).")
	m.auditMissing = cv("audit_missing_total", "Published events the auditor found missing from the stream (or published with no landing recorded), by kind of audit.")
	m.auditRepaired = cv("audit_repaired_total", "Missing events the auditor published again, by kind of audit.")
	m.auditAltered = cv("audit_altered_total", "Events the auditor found in the stream with other content (subject or payload) than their outbox rows, by kind of audit: published under their identity by another than the relay; alert on any.")
	outcome := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "relay", Name: name, Help: help}, []string{"outcome"})
	}
	m.atomicBatches = outcome("atomic_batches_total", "Atomic batches the relay sent, by outcome: stored (whole), or refused (refused or unanswered: their events went again another way or later).")
	m.atomicEvents = outcome("atomic_batch_events_total", "Events in the atomic batches the relay sent, by the batch's outcome.")
	reg.MustRegister(m.claimSeconds, m.slotLagBytes, m.slotStuckSeconds, m.outboxRanges, m.configDifferences,
		m.auditChecked, m.auditMissing, m.auditRepaired, m.auditAltered, m.atomicBatches, m.atomicEvents)
	return m
}

func (m *Metrics) Audited(kind string, checked, missing, repaired int) {
	m.auditChecked.WithLabelValues(kind).Add(float64(checked))
	m.auditMissing.WithLabelValues(kind).Add(float64(missing))
	m.auditRepaired.WithLabelValues(kind).Add(float64(repaired))
}

func (m *Metrics) AuditAltered(kind string, n int) {
	m.auditAltered.WithLabelValues(kind).Add(float64(n))
}

func (m *Metrics) AtomicBatch(events int, err error) {
	outcome := "stored"
	if err != nil {
		outcome = "refused"
	}
	m.atomicBatches.WithLabelValues(outcome).Inc()
	m.atomicEvents.WithLabelValues(outcome).Add(float64(events))
}

func (m *Metrics) ConfigDifferences(object string, n int) {
	m.configDifferences.WithLabelValues(object).Set(float64(n))
}

func (m *Metrics) Claimed(n int, took time.Duration) {
	m.claimed.Add(float64(n))
	m.claimSeconds.Observe(took.Seconds())
}

func (m *Metrics) Published(evs []Published) {
	m.published.Add(float64(len(evs)))
	took := make([]time.Duration, len(evs))
	for i, e := range evs {
		if e.Duplicate {
			m.duplicates.Inc()
		}
		took[i] = e.AckedAt.Sub(e.CreatedAt)
	}
	m.stages.Observe(metrics.StagePublished, "", took...)
}

func (m *Metrics) Rewound() { m.rewinds.Inc() }

func (m *Metrics) Retried(n int) { m.retried.Add(float64(n)) }
func (m *Metrics) Failed(n int)  { m.failed.Add(float64(n)) }
func (m *Metrics) Reaped(n int)  { m.reaped.Add(float64(n)) }
func (m *Metrics) Deleted(n int) { m.deleted.Add(float64(n)) }

func (m *Metrics) OutboxRanges(held, dropped int) {
	m.outboxRanges.Set(float64(held))
	m.outboxRangesDropped.Add(float64(dropped))
}

func (m *Metrics) SlotLag(bytes int64, stuck time.Duration) {
	m.slotLagBytes.Set(float64(bytes))
	m.slotStuckSeconds.Set(stuck.Seconds())
}

// outboxCollector reads the backlog from Postgres when scraped (at most
// every metrics.ScrapeFresh).
type outboxCollector struct {
	store                   *outboxstore.Store
	logger                  *slog.Logger
	backlog, oldest, failed *prometheus.Desc
	held                    *prometheus.Desc
}

// NewOutboxCollector reports the outbox backlog (pending and sending
// rows), the age of the oldest pending row, failed rows, and the events
// they hold back under the relays' onFailed (relay.on_failed), read from
// Postgres at most every metrics.ScrapeFresh.
func NewOutboxCollector(pool *pgxpool.Pool, onFailed string, logger *slog.Logger) prometheus.Collector {
	store := outboxstore.New(pool)
	store.OnFailed = outboxstore.OnFailed(onFailed)
	return metrics.Cached(&outboxCollector{
		store: store, logger: logger,
		backlog: prometheus.NewDesc("fanout_outbox_backlog_rows", "Outbox rows not yet published (pending or sending).", nil, nil),
		oldest:  prometheus.NewDesc("fanout_outbox_oldest_pending_age_seconds", "Age of the oldest pending outbox row (0 if none).", nil, nil),
		failed:  prometheus.NewDesc("fanout_outbox_failed_rows", "Outbox rows marked failed.", nil, nil),
		held: prometheus.NewDesc("fanout_relay_outbox_held_rows",
			"Outbox events held behind a failed earlier event of their aggregate (relay.on_failed hold).", nil, nil),
	}, metrics.ScrapeFresh)
}

func (c *outboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.backlog
	ch <- c.oldest
	ch <- c.failed
	ch <- c.held
}

func (c *outboxCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), metrics.ScrapeTimeout)
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
