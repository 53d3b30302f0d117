package outboxstore

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// What a wal relay (relay.capture wal) reads and changes in the outbox's
// tables: its slot's record in relay_capture (schema migration 00006),
// the rows it decoded, the events that hold their aggregates, and, when
// a poll relay takes over from the wal relays, the rows their slot
// published. The replication slot itself is the relay's (package relay);
// only EndCapture drops it, in the transaction that forgets its record.

// StartCapture records the backlog bound of the replication slot just
// created: every row committed before the slot's consistent point has an
// id at most the highest id visible now; a row with a higher id was
// inserted later, so the slot decodes it. The snapshot the bound is read
// in is recorded with it (SlotBacklog.Snapshot). An earlier record of a slot
// of that name is replaced, its backlog not done.
func (s *Store) StartCapture(ctx context.Context, slot string) error {
	_, err := s.pool.Exec(ctx, `
INSERT INTO relay_capture (slot_name, backlog_through, backlog_snapshot)
VALUES ($1, (SELECT coalesce(max(id), 0) FROM outbox), pg_current_snapshot())
ON CONFLICT (slot_name) DO UPDATE SET backlog_through = EXCLUDED.backlog_through, backlog_snapshot = EXCLUDED.backlog_snapshot,
    created_at = now(), backlog_done_at = NULL`,
		slot)
	return err
}

// SlotBacklog is a replication slot's backlog: the rows committed before the
// slot existed, which it never decodes.
type SlotBacklog struct {
	// Through bounds the backlog's ids: a row with a higher id was
	// inserted after the slot existed. A row at or below it may be the
	// slot's too (its transaction was in flight when the bound was read).
	Through int64
	// Snapshot is the snapshot the bound was read in (pg_snapshot's text
	// form), or "" for a record made before migration 00023. A writer
	// transaction visible in it committed before the record, so all its
	// rows are at or below Through; one that is not commits later, and
	// the slot decodes it whole.
	Snapshot string
	Done     bool // every row of the backlog was published
}

// CaptureBacklog returns the slot's backlog. A relay that died between
// creating the slot and recording its backlog left no record: the bound
// recorded now is higher, which only claims more rows (JetStream drops
// those the slot also published).
func (s *Store) CaptureBacklog(ctx context.Context, slot string) (SlotBacklog, error) {
	var b SlotBacklog
	var snap pgtype.Text
	var doneAt pgtype.Timestamptz
	err := s.pool.QueryRow(ctx, `
INSERT INTO relay_capture (slot_name, backlog_through, backlog_snapshot)
VALUES ($1, (SELECT coalesce(max(id), 0) FROM outbox), pg_current_snapshot())
ON CONFLICT (slot_name) DO UPDATE SET slot_name = EXCLUDED.slot_name
RETURNING backlog_through, backlog_snapshot::text, backlog_done_at`, slot).Scan(&b.Through, &snap, &doneAt)
	b.Snapshot, b.Done = snap.String, doneAt.Valid
	return b, err
}

// CaptureBacklogDone records that the rows up to through, the slot's
// backlog bound, were all published.
func (s *Store) CaptureBacklogDone(ctx context.Context, slot string, through int64) error {
	_, err := s.pool.Exec(ctx, `UPDATE relay_capture SET backlog_done_at = now() WHERE slot_name = $1 AND backlog_through = $2`, slot, through)
	return err
}

// ReadCapture reads the slot's record without making one: its backlog
// bound and whether the backlog was published; ok is false if the slot
// has none.
func (s *Store) ReadCapture(ctx context.Context, slot string) (through int64, done, ok bool, err error) {
	err = s.pool.QueryRow(ctx, `
SELECT coalesce(max(backlog_through), -1), coalesce(bool_or(backlog_done_at IS NOT NULL), false)
FROM relay_capture WHERE slot_name = $1`, slot).Scan(&through, &done)
	return through, done, err == nil && through >= 0, err
}

// EndCapture forgets the slot's record and drops the replication slot, in
// one transaction: a slot left without its record (the drop failed) could
// not be taken over from, and a record left without its slot would still
// say the relays capture from the WAL (Held, Republish). Dropping a slot
// takes the REPLICATION attribute.
func (s *Store) EndCapture(ctx context.Context, slot string) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DELETE FROM relay_capture WHERE slot_name = $1`, slot); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot)
		return err
	})
}

// PendingSpan reads the ids of the first and last pending, unpublished
// rows and when the oldest of them was created (0, 0 and the zero time if
// there are none): what a slot the server invalidated leaves to publish
// again.
func (s *Store) PendingSpan(ctx context.Context) (first, last int64, oldest time.Time, err error) {
	var created pgtype.Timestamptz
	err = s.pool.QueryRow(ctx, `
SELECT coalesce(min(id), 0), coalesce(max(id), 0), min(created_at)
FROM outbox WHERE published_at IS NULL AND status = 'pending'`).Scan(&first, &last, &created)
	return first, last, created.Time, err
}

// HoldingEvent is the first failed event of an aggregate, still
// unpublished: under relay.on_failed hold it holds the aggregate's later
// events.
type HoldingEvent struct {
	ID        int64
	Aggregate AggregateKey
	Seq       int64
}

// HoldingEvents reads the failed events that hold their aggregates, one
// per aggregate (rows without a number, written before migration 00009,
// hold nothing).
func (s *Store) HoldingEvents(ctx context.Context) ([]HoldingEvent, error) {
	rows, err := s.pool.Query(ctx, `
SELECT DISTINCT ON (aggregate_type, aggregate_id) id, aggregate_type, aggregate_id, aggregate_seq
FROM outbox
WHERE published_at IS NULL AND status = 'failed' AND aggregate_seq IS NOT NULL
ORDER BY aggregate_type, aggregate_id, aggregate_seq`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (HoldingEvent, error) {
		var h HoldingEvent
		err := row.Scan(&h.ID, &h.Aggregate.Type, &h.Aggregate.ID, &h.Seq)
		return h, err
	})
}

// markCapturedSQL marks sent the pending rows with ids in ($2, $3] that
// snapshot $1 shows. A row's xmin is 32 bits: its full id is the one below
// the snapshot's xmax with those low bits. The wal relay updates no row it
// publishes, so a pending row's xmin is the transaction the slot decoded
// it from: its writer's, or the operator's that returned it to pending.
const markCapturedSQL = `
WITH s AS (
    SELECT $1::pg_snapshot AS snap, pg_snapshot_xmax($1::pg_snapshot)::text::bigint AS xmax
)
UPDATE outbox o
SET status = 'sent', published_at = now(), last_error = NULL
FROM s
WHERE o.id > $2 AND o.id <= $3 AND o.published_at IS NULL AND o.status = 'pending'
  AND pg_visible_in_snapshot((
        ((s.xmax >> 32) << 32 | o.xmin::text::bigint)
        - CASE WHEN ((s.xmax >> 32) << 32 | o.xmin::text::bigint) >= s.xmax THEN 4294967296 ELSE 0 END
      )::text::xid8, s.snap)`

// markCapturedSpan is how many ids one statement of MarkCapturedSent
// covers, so that no transaction holds many rows for long.
const markCapturedSpan = 50_000

// MarkCapturedSent marks sent the pending rows with ids above after that
// snapshot (a pg_current_snapshot() as text) shows: a poll relay taking
// over from the wal relays, once their slot published every transaction
// the snapshot shows, so that it does not publish them again. It marks in
// id ranges (markCapturedSpan), from after or from just below the lowest
// id, whichever is higher, up to the highest, and returns how many rows
// it marked.
func (s *Store) MarkCapturedSent(ctx context.Context, snapshot string, after int64) (int64, error) {
	var minID, maxID int64
	if err := s.pool.QueryRow(ctx, `SELECT coalesce(min(id), 0), coalesce(max(id), 0) FROM outbox`).Scan(&minID, &maxID); err != nil {
		return 0, err
	}
	var marked int64
	for lo := max(after, minID-1); lo < maxID; lo += markCapturedSpan {
		ct, err := s.pool.Exec(ctx, markCapturedSQL, snapshot, lo, lo+markCapturedSpan)
		if err != nil {
			return marked, err
		}
		marked += ct.RowsAffected()
	}
	return marked, nil
}

// Unpublished reads the rows among ids that are pending and unpublished,
// as a claim would return them, without claiming them.
func (s *Store) Unpublished(ctx context.Context, ids []int64) ([]Claimed, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, aggregate_seq
FROM outbox
WHERE id = ANY($1) AND published_at IS NULL AND status = 'pending'
ORDER BY id`, ids)
	if err != nil {
		return nil, fmt.Errorf("read pending outbox rows: %w", err)
	}
	found, err := pgx.CollectRows(rows, scanClaimed)
	if err != nil {
		return nil, fmt.Errorf("read pending outbox rows: %w", err)
	}
	return found, nil
}

// inBacklogSQL is the condition on an outbox row o that it is in a
// slot's backlog: its id at most $1 and, if $2 (a snapshot's text) is not
// empty, its writer transaction visible in that snapshot (a row without
// one is from before migration 00022, committed long before).
const inBacklogSQL = `o.id <= $1 AND ($2 = '' OR o.writer_xid IS NULL OR pg_visible_in_snapshot(o.writer_xid, nullif($2, '')::pg_snapshot))`

// UnsentThrough counts the rows of a slot's backlog (ids up to maxID, of
// transactions visible in snapshot if it is not empty) that are still to
// be published (pending or sending; failed rows wait for an operator).
//
// With failed rows holding their aggregates (OnFailed hold), the rows held
// behind one are not counted: MarkHeldThrough marks them.
func (s *Store) UnsentThrough(ctx context.Context, maxID int64, snapshot string) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `
SELECT count(*) FROM outbox o
WHERE published_at IS NULL AND status IN ('pending', 'sending') AND `+inBacklogSQL+`
  AND NOT ($3 AND EXISTS (
      SELECT FROM outbox f
      WHERE f.aggregate_type = o.aggregate_type AND f.aggregate_id = o.aggregate_id
        AND f.aggregate_seq < o.aggregate_seq AND num_nulls(f.published_at) = 1 AND f.status = 'failed'))`,
		maxID, snapshot, s.OnFailed != SkipFailed).Scan(&n)
	return n, err
}

// MarkHeldThrough marks failed (HeldBehindReason) the pending rows of a
// slot's backlog (as UnsentThrough's) held behind a failed row of their
// aggregate: a wal relay's backlog leaves them so, and an operator's
// retry-failed or skip then returns them through the slot, in order.
func (s *Store) MarkHeldThrough(ctx context.Context, maxID int64, snapshot string) (int64, error) {
	ct, err := s.pool.Exec(ctx, `
UPDATE outbox o
SET status = 'failed', last_error = $3 || h.failed_id || $4
FROM (
    SELECT o.id, (SELECT min(f.id) FROM outbox f
                  WHERE f.aggregate_type = o.aggregate_type AND f.aggregate_id = o.aggregate_id
                    AND f.aggregate_seq < o.aggregate_seq AND num_nulls(f.published_at) = 1 AND f.status = 'failed') AS failed_id
    FROM outbox o
    WHERE o.published_at IS NULL AND o.status = 'pending' AND `+inBacklogSQL+`
) h
WHERE o.id = h.id AND h.failed_id IS NOT NULL AND o.status = 'pending' AND o.published_at IS NULL`,
		maxID, snapshot, HeldBehindPrefix, strings.TrimPrefix(HeldBehindReason(0), HeldBehindPrefix+"0"))
	return ct.RowsAffected(), err
}

// FailUnclaimed marks rows failed that were never claimed: a wal relay
// publishes rows it decoded from the slot, which stay `pending` in the
// table, and marks only those it can never publish. It returns the ids it
// marked.
func (s *Store) FailUnclaimed(ctx context.Context, ids []int64, reasons []string) ([]int64, error) {
	rows, err := s.pool.Query(ctx, `
UPDATE outbox o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.reason
FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
WHERE o.id = f.id AND o.published_at IS NULL AND o.status = 'pending'
RETURNING o.id`, ids, reasons)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}
