package subscribers

// Backfill: a subscriber starts from Postgres's current state, not only
// from what the stream still holds (DESIGN.md, invariant 12). Its
// declaration names the table its state derives from and how a row
// becomes an event its handler understands; `fanout backfill` reads the
// table in key order, in chunks, and hands each chunk to the handler
// (backfiller.go), with a checkpoint that commits with the chunk's effects.
//
// Merging with live events: a backfill event names its row (a key in its
// payload) and nothing of the row's state. The handler derives the state
// from Postgres when it applies the event, and writes it only over an
// older version of it (a version column the writers bump, such as
// products.version, or a state that is created once, such as an order's
// invoice). A live event and a backfill event of the same row may then
// apply in either order, and either may apply again: the effect ends at
// the row's latest state, never an older one. This is the version-based
// alternative to the watermarks of incremental snapshots (DBLog,
// Debezium): those close the window between reading a row and applying
// it by holding back the chunk until the log passes a watermark; here the
// handler reads the row at apply time, and the version closes the race
// between two appliers.

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// Backfill is how a subscriber's state derives from Postgres: each row of
// Table becomes one event of type EventType.
type Backfill struct {
	// Table is the table read, in the order of Key: "orders".
	Table string
	// Key is a bigint column of Table whose values are unique and never
	// null (its primary key): the chunks are key ranges ("id").
	Key string
	// EventType is the type of the event each row becomes, one of the
	// subscriber's EventTypes: "order.created". Its handler gets it as it
	// gets a live event of that type, with the BackfillHeader set.
	EventType string
	// AggregateType is the events' aggregate type: "order".
	AggregateType string
	// AggregateID is an SQL expression over the row giving its aggregate
	// id ("id::text"); the key when empty.
	AggregateID string
	// Payload is an SQL expression over the row giving the event's payload
	// as jsonb: "jsonb_build_object('order_id', id)". Name the row, and
	// let the handler read its state (see "Merging with live events").
	Payload string
}

// BackfillHeader is set on every event a backfill hands to a handler: its
// value is "<table>:<key>", the row it came from. Such an event has no
// outbox id (ID 0) and no stream sequence.
const BackfillHeader = "Fanout-Backfill"

func (b *Backfill) validate(eventTypes []string, ordered bool) error {
	var errs []error
	if !tableRE.MatchString(b.Table) {
		errs = append(errs, fmt.Errorf("backfill table %q: want a lower-case SQL name", b.Table))
	}
	if !tableRE.MatchString(b.Key) {
		errs = append(errs, fmt.Errorf("backfill key %q: want a lower-case SQL column name", b.Key))
	}
	if !slices.ContainsFunc(eventTypes, func(p string) bool { return SubjectMatches(p, b.EventType) }) {
		errs = append(errs, fmt.Errorf("backfill event type %q: not one of the subscriber's event types %v", b.EventType, eventTypes))
	}
	if strings.ContainsAny(b.EventType, "*> ") || b.EventType == "" {
		errs = append(errs, fmt.Errorf("backfill event type %q: want one event type, not a pattern", b.EventType))
	}
	if b.AggregateType == "" {
		errs = append(errs, errors.New("backfill: no aggregate type"))
	}
	if strings.TrimSpace(b.Payload) == "" {
		errs = append(errs, errors.New("backfill: no payload expression"))
	}
	if ordered {
		// An ordered subscriber's per-aggregate checkpoint would have to
		// take a backfill event as the aggregate's state at its last
		// number (outbox_aggregates.last_seq, read in the chunk's
		// snapshot), and the live events at or below it as applied. Not
		// built yet: refused rather than run out of order.
		errs = append(errs, errors.New("backfill: ordered subscribers cannot declare a backfill yet"))
	}
	return errors.Join(errs...)
}

// chunkSQL reads one chunk of a segment: the rows after a key ($1), up to
// the segment's last key ($2), at most $3 of them, in key order.
func (b *Backfill) chunkSQL(where string) string {
	id := b.AggregateID
	if strings.TrimSpace(id) == "" {
		id = "t." + b.Key + "::text"
	}
	return fmt.Sprintf(`SELECT t.%[2]s, (%[3]s)::text, (%[4]s)::jsonb FROM %[1]s AS t
WHERE t.%[2]s > $1 AND t.%[2]s <= $2 AND (%[5]s)
ORDER BY t.%[2]s LIMIT $3`, b.Table, b.Key, id, b.Payload, whereOrTrue(where))
}

// boundsSQL reads the backfill's least and greatest keys and how many rows
// it has to do.
func (b *Backfill) boundsSQL(where string) string {
	return fmt.Sprintf(`WITH high AS (SELECT coalesce(min(%[2]s), 0) AS lo, coalesce(max(%[2]s), 0) AS hi FROM %[1]s)
SELECT high.lo, high.hi, (SELECT count(*) FROM %[1]s AS t WHERE t.%[2]s <= high.hi AND (%[3]s)) FROM high`, b.Table, b.Key, whereOrTrue(where))
}

func whereOrTrue(where string) string {
	if strings.TrimSpace(where) == "" {
		return "true"
	}
	return where
}

// BackfillMetrics are a backfill's gauges, set from its progress.
type BackfillMetrics struct {
	total, done, failed, paused *prometheus.GaugeVec
}

// NewBackfillMetrics registers the backfill gauges on reg.
func NewBackfillMetrics(reg prometheus.Registerer) *BackfillMetrics {
	gauge := func(name, help string) *prometheus.GaugeVec {
		g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "fanout", Subsystem: "subscriber", Name: name, Help: help}, []string{"subscriber"})
		reg.MustRegister(g)
		return g
	}
	return &BackfillMetrics{
		total:  gauge("backfill_rows", "Rows the subscriber's backfill has to handle (as counted when it started)."),
		done:   gauge("backfill_rows_done", "Rows the subscriber's backfill has handled."),
		failed: gauge("backfill_rows_failed", "Rows the subscriber's backfill could not apply (subscriber_backfill_failures)."),
		paused: gauge("backfill_paused", "1 while the subscriber's backfill is paused."),
	}
}

// Observe sets the gauges from s.
func (m *BackfillMetrics) Observe(s BackfillStatus) {
	m.total.WithLabelValues(s.Subscriber).Set(float64(s.Total))
	m.done.WithLabelValues(s.Subscriber).Set(float64(s.Done))
	m.failed.WithLabelValues(s.Subscriber).Set(float64(s.Failed))
	p := 0.0
	if s.Paused {
		p = 1
	}
	m.paused.WithLabelValues(s.Subscriber).Set(p)
}
