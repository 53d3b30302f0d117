package subscribers

// The per-aggregate checkpoint of the ordered subscribers,
// subscriber_aggregates: the number of the last event applied, moved from
// n-1 to n in the handler's transaction; what becomes of an event that may
// not be applied now (held behind a dead letter, late, or out of turn); and
// what a dead letter does to its aggregate (holds it, or lets it pass).

import (
	"context"
	"errors"
	"fmt"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DeadHeldByHeader is set on the dead letter of an event held behind an
// earlier dead-lettered event of its aggregate: the id of that event.
const DeadHeldByHeader = "Fanout-Dead-Held-By"

// The statements on subscriber_aggregates, the per-aggregate checkpoint.
const (
	// advanceSQL moves each aggregate's checkpoint to its event's number,
	// where it is at the number expected (prev) and not held behind
	// another event. The event holding an aggregate releases it (a redrive).
	// An aggregate's first checkpoint row is made only by its first event
	// (prev 0) or by an event applied after a gap ($7): an instance whose
	// view of the aggregate is stale (the pin moved while its first event
	// was with another instance) cannot start it at its second.
	advanceSQL = `
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

	// aggregatesSQL reads the checkpoints of some aggregates (no row: none
	// of its events applied yet).
	aggregatesSQL = `
SELECT w.d, w.t, w.i, a.last_seq, a.held_by_event, a.held_seq
FROM unnest($2::text[], $3::text[], $4::text[]) AS w(d, t, i)
LEFT JOIN subscriber_aggregates a
       ON a.subscriber = $1 AND a.origin_database = w.d AND a.aggregate_type = w.t AND a.aggregate_id = w.i`

	// holdSQL holds an aggregate behind its dead-lettered event (unless it
	// is held already, or moved past the event).
	holdSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, held_by_event, held_seq, origin_database)
VALUES ($1, $2, $3, $4::bigint - 1, $4::bigint - 1, $5::bigint, $4::bigint, $6)
ON CONFLICT (subscriber, origin_database, aggregate_type, aggregate_id) DO UPDATE
SET held_by_event = excluded.held_by_event, held_seq = excluded.held_seq, updated_at = now()
WHERE a.held_by_event IS NULL AND a.last_seq < excluded.held_seq`

	// passSQL lets an aggregate move past its dead-lettered event.
	passSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, last_event_id, origin_database)
VALUES ($1, $2, $3, $4::bigint, $4::bigint - 1, $5::bigint, $6)
ON CONFLICT (subscriber, origin_database, aggregate_type, aggregate_id) DO UPDATE
SET last_seq = excluded.last_seq, prev_seq = a.last_seq, last_event_id = excluded.last_event_id, updated_at = now()
WHERE a.held_by_event IS NULL AND a.last_seq < excluded.last_seq`

	releaseSQL = `
UPDATE subscriber_aggregates
SET last_seq = held_seq, prev_seq = last_seq, last_event_id = held_by_event, held_by_event = NULL, held_seq = NULL, updated_at = now()
WHERE subscriber = $1 AND held_by_event = $2`

	countHeldSQL = `SELECT subscriber, count(*) FROM subscriber_aggregates WHERE held_by_event IS NOT NULL GROUP BY subscriber`
)

// CountHeldAggregates returns, per ordered subscriber, how many aggregates
// are held behind a dead-lettered event.
func CountHeldAggregates(ctx context.Context, pool *pgxpool.Pool) (map[string]int64, error) {
	counts, err := countBySubscriber(ctx, pool, countHeldSQL)
	if err != nil {
		return nil, fmt.Errorf("count held aggregates: %w", err)
	}
	return counts, nil
}

// Release lets an ordered subscriber's aggregate held behind event (its
// dead letter discarded by an operator) move past it: the events held
// behind it can then be redriven, in order, and its later events flow
// again. It reports whether event held an aggregate.
func Release(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, subscriber string, event int64) (bool, error) {
	ct, err := q.Exec(ctx, releaseSQL, subscriber, event)
	if err != nil {
		return false, fmt.Errorf("release the aggregate held behind event %d: %w", event, err)
	}
	return ct.RowsAffected() > 0, nil
}

// errOutOfTurn: the checkpoint of the event's aggregate is not where the
// dispatcher thought (another instance moved it, or an earlier event is
// still missing). Not the event's fault: it is tried again.
var errOutOfTurn = errors.New("not its aggregate's next event")

// heldError: the event's aggregate is held behind a dead-lettered event.
type heldError struct {
	by, bySeq int64
	seq       int64
}

func (e *heldError) Error() string {
	return fmt.Sprintf("held behind event %d (number %d of its aggregate), which went to the dead letters before it "+
		"(subscribers.on_dead_letter=hold): redrive event %d first, then this one (number %d)", e.by, e.bySeq, e.by, e.seq)
}

// advance moves the per-aggregate checkpoints of the fresh, numbered
// events in ds, in the handler's transaction. An event that may not be
// applied now is an error: held or late (the dead letters), or out of
// turn (tried again).
func (r *Runner) advance(ctx context.Context, tx pgx.Tx, ds []*delivery, fresh map[int64]bool) error {
	var types, ids, dbs []string
	var seqs, prevs, events []int64
	var afterGap []bool
	late := map[int64]bool{}
	epochs := map[int64]int{}
	idOf := map[int64]int64{} // checkpoint key -> event id, for the messages
	for _, d := range ds {
		if !fresh[d.ev.key()] || d.ev.AggregateSeq == 0 {
			continue
		}
		types, ids = append(types, d.ev.AggregateType), append(ids, d.ev.AggregateID)
		dbs = append(dbs, r.origins.database(d.ev.Origin))
		prev := d.order.prev
		if !d.order.afterGap {
			prev = d.ev.AggregateSeq - 1
		}
		// Events are known by their checkpoint keys here, in the table
		// too (last_event_id, held_by_event): two databases' event 42 are
		// two events.
		key := d.ev.key()
		seqs, prevs, events = append(seqs, d.ev.AggregateSeq), append(prevs, prev), append(events, key)
		afterGap = append(afterGap, d.order.afterGap)
		late[key] = d.order.lateOK
		idOf[key] = d.ev.ID
		if o, err := outbox.ParseOrigin(d.ev.Origin); err == nil {
			epochs[key] = o.Epoch
		}
	}
	if len(events) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, advanceSQL, r.name, types, ids, seqs, prevs, events, afterGap, dbs)
	if err != nil {
		return fmt.Errorf("advance the aggregates' checkpoints: %w", err)
	}
	advanced, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("advance the aggregates' checkpoints: %w", err)
	}
	if len(advanced) == len(events) {
		return nil
	}
	// Why not: read the checkpoints of the aggregates left behind.
	done := map[int64]bool{}
	for _, id := range advanced {
		done[id] = true
	}
	var left []aggregateKey
	var lseq, lev []int64
	for i, id := range events {
		if !done[id] {
			left, lseq, lev = append(left, aggregateKey{dbs[i], types[i], ids[i]}), append(lseq, seqs[i]), append(lev, id)
		}
	}
	states, err := r.aggregateStates(ctx, tx, left)
	if err != nil {
		return err
	}
	for i, id := range lev {
		k := left[i]
		st := states[k]
		switch {
		case st.heldBy != 0 && st.heldBy != id:
			return &eventError{id: idOf[id], err: Permanent(&heldError{by: st.heldBy, bySeq: st.heldSeq, seq: lseq[i]})}
		case st.last >= lseq[i] && late[id]:
			// An operator's redrive of an event its aggregate moved past:
			// applied, the checkpoint left as it is.
		case st.last >= lseq[i] && epochs[id] > 1:
			return &eventError{id: idOf[id], err: Permanent(fmt.Errorf(
				"arrived after its aggregate %s/%s moved past it: this is number %d, and number %d is applied; "+
					"the event is of outbox epoch %d: its database was restored from a backup, and the events it lost had used the numbers "+
					"its new events are given again (redrive this one to apply it)",
				k.typ, k.id, lseq[i], st.last, epochs[id]))}
		case st.last >= lseq[i]:
			return &eventError{id: idOf[id], err: Permanent(fmt.Errorf(
				"arrived after its aggregate %s/%s moved past it: this is number %d, and number %d is applied "+
					"(it was let pass: a gap given up on after subscribers.gap_wait, or a dead letter under on_dead_letter=skip)",
				k.typ, k.id, lseq[i], st.last))}
		default:
			return &eventError{id: idOf[id], err: fmt.Errorf("event %d (number %d of %s/%s): %w: the checkpoint is at number %d",
				idOf[id], lseq[i], k.typ, k.id, errOutOfTurn, st.last)}
		}
	}
	return nil
}

// aggregateState is one aggregate's checkpoint as read.
type aggregateState struct {
	exists          bool
	last            int64
	heldBy, heldSeq int64
}

func (r *Runner) aggregateStates(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, keys []aggregateKey) (map[aggregateKey]aggregateState, error) {
	dbs, types, ids := make([]string, len(keys)), make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		dbs[i], types[i], ids[i] = k.db, k.typ, k.id
	}
	rows, err := q.Query(ctx, aggregatesSQL, r.name, dbs, types, ids)
	if err != nil {
		return nil, fmt.Errorf("read the aggregates' checkpoints: %w", err)
	}
	out := make(map[aggregateKey]aggregateState, len(keys))
	var k aggregateKey
	var last, heldBy, heldSeq *int64
	_, err = pgx.ForEachRow(rows, []any{&k.db, &k.typ, &k.id, &last, &heldBy, &heldSeq}, func() error {
		st := aggregateState{exists: last != nil}
		if last != nil {
			st.last = *last
		}
		if heldBy != nil {
			st.heldBy = *heldBy
		}
		if heldSeq != nil {
			st.heldSeq = *heldSeq
		}
		out[k] = st
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the aggregates' checkpoints: %w", err)
	}
	return out, nil
}

// afterDeadLetter records what a dead-lettered event of an ordered
// subscriber does to its aggregate: holds it (on_dead_letter=hold) or lets
// it pass (skip). An event held behind another changes nothing.
func (r *Runner) afterDeadLetter(ctx context.Context, d *delivery) error {
	if !r.ordered || d.ev.AggregateSeq == 0 || d.heldBy != 0 {
		return nil
	}
	ctx, cancel := r.bookkeeping(ctx)
	defer cancel()
	sql := holdSQL
	if r.cfg.OnDeadLetter == "skip" {
		sql = passSQL
	}
	_, err := r.opts.Pool.Exec(ctx, sql, r.name, d.ev.AggregateType, d.ev.AggregateID, d.ev.AggregateSeq, d.ev.key(), r.origins.database(d.ev.Origin))
	if err != nil {
		return fmt.Errorf("record the dead letter in its aggregate's checkpoint: %w", err)
	}
	return nil
}
