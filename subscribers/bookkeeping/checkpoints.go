package bookkeeping

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements on processed_events, the subscribers' checkpoint: one row
// per (subscriber, event) handled. An event is known by its checkpoint key
// (its id, or its origin's number and its id: see the runtime's origin.go).
const (
	// checkpointClaimSQL claims a batch's events in the checkpoint;
	// RETURNING names the ones not processed before. The ids are sorted,
	// so two transactions claiming overlapping batches lock in the same
	// order.
	checkpointClaimSQL = `
INSERT INTO processed_events (subscriber, event_id)
SELECT $1, id FROM unnest($2::bigint[]) AS id
ON CONFLICT DO NOTHING
RETURNING event_id`

	// checkpointInsertSQL records events handled outside Postgres.
	checkpointInsertSQL = `
INSERT INTO processed_events (subscriber, event_id)
SELECT $1, id FROM unnest($2::bigint[]) AS id
ON CONFLICT DO NOTHING`

	checkpointListSQL = `SELECT event_id FROM processed_events WHERE subscriber = $1 AND event_id = ANY($2)`

	checkpointExistsSQL = `SELECT EXISTS (SELECT FROM processed_events WHERE subscriber = $1 AND event_id = $2)`

	// checkpointAnySQL: the row -1 is the start's access check, not an
	// event.
	checkpointAnySQL = `SELECT EXISTS (SELECT FROM processed_events WHERE subscriber = $1 AND event_id >= 0)`

	checkpointDeleteSQL = `DELETE FROM processed_events WHERE subscriber = $1 AND event_id = $2`

	checkpointCountSQL = `SELECT subscriber, count(*) FROM processed_events GROUP BY subscriber`

	// checkpointPruneSQL deletes one batch (CheckpointPruneBatch rows) of a
	// subscriber's checkpoint rows older than the stream's max age: past
	// it, the stream no longer holds the event, so it can never be
	// delivered again.
	checkpointPruneSQL = `
DELETE FROM processed_events
WHERE subscriber = $1 AND event_id IN (
    SELECT event_id FROM processed_events
    WHERE subscriber = $1 AND processed_at < now() - make_interval(secs => $2::float8)
    LIMIT 5000
)`
)

// CheckpointPruneBatch is how many rows one CheckpointPrune deletes at
// most: a prune deletes batches until one comes back short.
const CheckpointPruneBatch = 5000

// CheckpointParams names some events of a subscriber, by their checkpoint
// keys (sorted, distinct: see CheckpointClaim).
type CheckpointParams struct {
	Subscriber string
	EventIDs   []int64
}

// CheckpointClaim inserts the events' checkpoint rows, in the transaction
// of their effects, and returns the keys that were not there before (the
// events to handle now).
func (s Store) CheckpointClaim(ctx context.Context, p CheckpointParams) ([]int64, error) {
	return collect(ctx, s.db, pgx.RowTo[int64], checkpointClaimSQL, p.Subscriber, p.EventIDs)
}

// CheckpointRecordParams are events handled outside Postgres and the
// events whose attempts rows are done with.
type CheckpointRecordParams struct {
	Subscriber string
	Handled    []int64 // checkpointed
	Forget     []int64 // their subscriber_attempts rows deleted
}

// CheckpointRecord checkpoints the handled events and forgets the attempts
// of every event done with, in one round trip (a batch runs as one
// implicit transaction).
func (s Store) CheckpointRecord(ctx context.Context, p CheckpointRecordParams) error {
	b := &pgx.Batch{}
	if len(p.Handled) > 0 {
		b.Queue(checkpointInsertSQL, p.Subscriber, p.Handled)
	}
	if len(p.Forget) > 0 {
		b.Queue(attemptDeleteSQL, p.Subscriber, p.Forget)
	}
	if b.Len() == 0 {
		return nil
	}
	return s.db.SendBatch(ctx, b).Close()
}

// CheckpointList returns the keys among p.EventIDs already in the
// checkpoint.
func (s Store) CheckpointList(ctx context.Context, p CheckpointParams) ([]int64, error) {
	return collect(ctx, s.db, pgx.RowTo[int64], checkpointListSQL, p.Subscriber, p.EventIDs)
}

// CheckpointKeyParams names one event of a subscriber.
type CheckpointKeyParams struct {
	Subscriber string
	EventID    int64 // its checkpoint key
}

// CheckpointExists reports whether the event is in the checkpoint.
func (s Store) CheckpointExists(ctx context.Context, p CheckpointKeyParams) (bool, error) {
	var ok bool
	err := s.db.QueryRow(ctx, checkpointExistsSQL, p.Subscriber, p.EventID).Scan(&ok)
	return ok, err
}

// CheckpointDelete deletes the event's checkpoint row (tests: a pruned
// checkpoint).
func (s Store) CheckpointDelete(ctx context.Context, p CheckpointKeyParams) error {
	return s.exec(ctx, checkpointDeleteSQL, p.Subscriber, p.EventID)
}

// CheckpointAny reports whether the subscriber has checkpointed any event.
func (s Store) CheckpointAny(ctx context.Context, subscriber string) (bool, error) {
	var seen bool
	err := s.db.QueryRow(ctx, checkpointAnySQL, subscriber).Scan(&seen)
	return seen, err
}

// CheckpointCount returns each subscriber's number of checkpoint rows.
func (s Store) CheckpointCount(ctx context.Context) (map[string]int64, error) {
	return s.countBySubscriber(ctx, checkpointCountSQL)
}

// PruneParams are a subscriber and the age past which its rows go.
type PruneParams struct {
	Subscriber string
	OlderThan  time.Duration
}

// CheckpointPrune deletes at most CheckpointPruneBatch of the
// subscriber's checkpoint rows older than p.OlderThan and returns how many
// it deleted.
func (s Store) CheckpointPrune(ctx context.Context, p PruneParams) (int64, error) {
	ct, err := s.db.Exec(ctx, checkpointPruneSQL, p.Subscriber, p.OlderThan.Seconds())
	return ct.RowsAffected(), err
}
