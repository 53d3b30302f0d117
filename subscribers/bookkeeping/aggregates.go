package bookkeeping

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgtype/zeronull"
)

// The statements on subscriber_aggregates, the ordered subscribers'
// per-aggregate checkpoint: the number of the last event applied, moved
// from n-1 to n in the handler's transaction, and the dead-lettered event
// an aggregate is held behind. Events are known here by their checkpoint
// keys (last_event_id, held_by_event): two databases' event 42 are two
// events.
const (
	// aggregateAdvanceSQL moves each aggregate's checkpoint to its event's
	// number, where it is at the number expected (prev) and not held behind
	// another event. The event holding an aggregate releases it (a redrive).
	// An aggregate's first checkpoint row is made only by its first event
	// (prev 0) or by an event applied after a gap ($7): an instance whose
	// view of the aggregate is stale (the pin moved while its first event
	// was with another instance) cannot start it at its second.
	aggregateAdvanceSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, origin_database, aggregate_type, aggregate_id, last_seq, prev_seq, last_event_id)
SELECT $1, d, t, i, s, p, e FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bool[], $8::text[]) AS w(t, i, s, p, e, g, d)
WHERE w.p = 0 OR w.g OR EXISTS (
    SELECT FROM subscriber_aggregates x
    WHERE x.subscriber = $1 AND x.origin_database = w.d AND x.aggregate_type = w.t AND x.aggregate_id = w.i)
ON CONFLICT (subscriber, origin_database, aggregate_type, aggregate_id) DO UPDATE
SET last_seq = excluded.last_seq, prev_seq = excluded.prev_seq, last_event_id = excluded.last_event_id,
    held_by_event = NULL, held_seq = NULL, updated_at = now()
WHERE a.last_seq = excluded.prev_seq AND (a.held_by_event IS NULL OR a.held_by_event = excluded.last_event_id)
RETURNING last_event_id`

	// aggregateListSQL reads the checkpoints of some aggregates (no row:
	// none of its events applied yet).
	aggregateListSQL = `
SELECT w.d, w.t, w.i, a.last_seq, a.held_by_event, a.held_seq
FROM unnest($2::text[], $3::text[], $4::text[]) AS w(d, t, i)
LEFT JOIN subscriber_aggregates a
       ON a.subscriber = $1 AND a.origin_database = w.d AND a.aggregate_type = w.t AND a.aggregate_id = w.i`

	// aggregateHoldSQL holds an aggregate behind its dead-lettered event
	// (unless it is held already, or moved past the event).
	aggregateHoldSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, held_by_event, held_seq, origin_database)
VALUES ($1, $2, $3, $4::bigint - 1, $4::bigint - 1, $5::bigint, $4::bigint, $6)
ON CONFLICT (subscriber, origin_database, aggregate_type, aggregate_id) DO UPDATE
SET held_by_event = excluded.held_by_event, held_seq = excluded.held_seq, updated_at = now()
WHERE a.held_by_event IS NULL AND a.last_seq < excluded.held_seq`

	// aggregatePassSQL lets an aggregate move past its dead-lettered event.
	aggregatePassSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, last_event_id, origin_database)
VALUES ($1, $2, $3, $4::bigint, $4::bigint - 1, $5::bigint, $6)
ON CONFLICT (subscriber, origin_database, aggregate_type, aggregate_id) DO UPDATE
SET last_seq = excluded.last_seq, prev_seq = a.last_seq, last_event_id = excluded.last_event_id, updated_at = now()
WHERE a.held_by_event IS NULL AND a.last_seq < excluded.last_seq`

	aggregateReleaseSQL = `
UPDATE subscriber_aggregates
SET last_seq = held_seq, prev_seq = last_seq, last_event_id = held_by_event, held_by_event = NULL, held_seq = NULL, updated_at = now()
WHERE subscriber = $1 AND held_by_event = $2`

	aggregateCountHeldSQL = `SELECT subscriber, count(*) FROM subscriber_aggregates WHERE held_by_event IS NOT NULL GROUP BY subscriber`
)

// AggregateKey names an aggregate: its database ("" for the subscriber's
// own), type and id.
type AggregateKey struct{ DB, Type, ID string }

// AggregateState is one aggregate's checkpoint as read.
type AggregateState struct {
	Exists          bool // it has a row
	Last            int64
	HeldBy, HeldSeq int64 // 0: not held
}

// AggregateAdvanceParams are events to apply, one per aggregate, in the
// handler's transaction (parallel slices, one entry per event).
type AggregateAdvanceParams struct {
	Subscriber string
	Keys       []AggregateKey
	Seqs       []int64 // each event's number in its aggregate
	Prevs      []int64 // the number its aggregate's checkpoint must be at
	Events     []int64 // each event's checkpoint key
	AfterGap   []bool  // applied after a gap given up on
}

// AggregateAdvance moves each aggregate's checkpoint to its event's number
// where it may (at Prevs[i], not held behind another event) and returns
// the keys of the events it moved.
func (s Store) AggregateAdvance(ctx context.Context, p AggregateAdvanceParams) ([]int64, error) {
	dbs, types, ids := splitKeys(p.Keys)
	return collect(ctx, s.db, pgx.RowTo[int64], aggregateAdvanceSQL, p.Subscriber, types, ids, p.Seqs, p.Prevs, p.Events, p.AfterGap, dbs)
}

// AggregateListParams names some aggregates of a subscriber.
type AggregateListParams struct {
	Subscriber string
	Keys       []AggregateKey
}

// AggregateList reads the checkpoints of the aggregates.
func (s Store) AggregateList(ctx context.Context, p AggregateListParams) (map[AggregateKey]AggregateState, error) {
	dbs, types, ids := splitKeys(p.Keys)
	rows, err := s.db.Query(ctx, aggregateListSQL, p.Subscriber, dbs, types, ids)
	if err != nil {
		return nil, err
	}
	out := make(map[AggregateKey]AggregateState, len(p.Keys))
	var k AggregateKey
	var st AggregateState
	var last pgtype.Int8
	_, err = pgx.ForEachRow(rows, []any{&k.DB, &k.Type, &k.ID, &last, (*zeronull.Int8)(&st.HeldBy), (*zeronull.Int8)(&st.HeldSeq)}, func() error {
		st.Exists, st.Last = last.Valid, last.Int64
		out[k] = st
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func splitKeys(keys []AggregateKey) (dbs, types, ids []string) {
	dbs, types, ids = make([]string, len(keys)), make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		dbs[i], types[i], ids[i] = k.DB, k.Type, k.ID
	}
	return dbs, types, ids
}

// AggregateDeadLetterParams is an event of an aggregate that went to the
// dead letters.
type AggregateDeadLetterParams struct {
	Subscriber string
	Key        AggregateKey
	Seq        int64 // its number in its aggregate
	Event      int64 // its checkpoint key
}

// AggregateHold holds the aggregate behind the dead-lettered event
// (subscribers.on_dead_letter hold), unless it is held already or moved
// past it.
func (s Store) AggregateHold(ctx context.Context, p AggregateDeadLetterParams) error {
	return s.exec(ctx, aggregateHoldSQL, p.Subscriber, p.Key.Type, p.Key.ID, p.Seq, p.Event, p.Key.DB)
}

// AggregatePass moves the aggregate past the dead-lettered event
// (subscribers.on_dead_letter skip).
func (s Store) AggregatePass(ctx context.Context, p AggregateDeadLetterParams) error {
	return s.exec(ctx, aggregatePassSQL, p.Subscriber, p.Key.Type, p.Key.ID, p.Seq, p.Event, p.Key.DB)
}

// AggregateRelease moves the aggregate held behind the event (its dead
// letter discarded) past it, and reports whether the event held one.
func (s Store) AggregateRelease(ctx context.Context, p CheckpointKeyParams) (bool, error) {
	return s.affected(ctx, aggregateReleaseSQL, p.Subscriber, p.EventID)
}

// AggregateCountHeld returns, per ordered subscriber, how many aggregates
// are held behind a dead-lettered event.
func (s Store) AggregateCountHeld(ctx context.Context) (map[string]int64, error) {
	return s.countBySubscriber(ctx, aggregateCountHeldSQL)
}
