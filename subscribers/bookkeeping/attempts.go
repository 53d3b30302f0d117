package bookkeeping

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// The statements on subscriber_attempts, the runtime's memory of events
// that did not go well the first time (what its counts mean: the runtime's
// attempts.go). First deliveries write nothing here.
const (
	attemptListSQL = `
SELECT q.id, p.event_id IS NOT NULL, a.event_id IS NOT NULL, coalesce(a.failures, 0), coalesce(a.open_attempts, 0),
       coalesce(a.last_error, '')
FROM unnest($2::bigint[]) AS q(id)
LEFT JOIN processed_events p ON p.subscriber = $1 AND p.event_id = q.id
LEFT JOIN subscriber_attempts a ON a.subscriber = $1 AND a.event_id = q.id`

	// The ids are sorted, so concurrent upserts lock rows in one order.
	attemptOpenSQL = `
INSERT INTO subscriber_attempts (subscriber, event_id, open_attempts)
SELECT $1, id, 1 FROM unnest($2::bigint[]) AS id ORDER BY id
ON CONFLICT (subscriber, event_id) DO UPDATE
SET open_attempts = subscriber_attempts.open_attempts + 1, updated_at = now()`

	attemptCloseSQL = `
UPDATE subscriber_attempts
SET open_attempts = greatest(open_attempts - 1, 0), updated_at = now()
WHERE subscriber = $1 AND event_id = ANY($2)`

	// $4 is 1 when this attempt was opened (it closes here), else 0.
	attemptFailSQL = `
INSERT INTO subscriber_attempts (subscriber, event_id, failures, last_error)
VALUES ($1, $2, 1, $3)
ON CONFLICT (subscriber, event_id) DO UPDATE
SET failures = subscriber_attempts.failures + 1,
    open_attempts = greatest(subscriber_attempts.open_attempts - $4, 0),
    last_error = excluded.last_error,
    updated_at = now()
RETURNING failures`

	attemptDeleteSQL = `DELETE FROM subscriber_attempts WHERE subscriber = $1 AND event_id = ANY($2)`

	attemptPruneSQL = `
DELETE FROM subscriber_attempts
WHERE ctid IN (
    SELECT ctid FROM subscriber_attempts
    WHERE subscriber = $1 AND updated_at < now() - make_interval(secs => $2::float8)
    LIMIT 10000
)`
)

// AttemptState is what the bookkeeping knows of a redelivered event.
type AttemptState struct {
	Done         bool // in the checkpoint
	HasRow       bool // subscriber_attempts holds a row for it
	Failures     int
	OpenAttempts int
	LastError    string
}

// AttemptList returns, for each of the events, whether it is in the
// checkpoint and its attempts row (zero values where it has none).
func (s Store) AttemptList(ctx context.Context, p CheckpointParams) (map[int64]AttemptState, error) {
	rows, err := s.db.Query(ctx, attemptListSQL, p.Subscriber, p.EventIDs)
	if err != nil {
		return nil, err
	}
	out := make(map[int64]AttemptState, len(p.EventIDs))
	var id int64
	var st AttemptState
	_, err = pgx.ForEachRow(rows, []any{&id, &st.Done, &st.HasRow, &st.Failures, &st.OpenAttempts, &st.LastError}, func() error {
		out[id] = st
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// AttemptOpen opens an attempt on each event (sorted keys): its handling
// begins.
func (s Store) AttemptOpen(ctx context.Context, p CheckpointParams) error {
	return s.exec(ctx, attemptOpenSQL, p.Subscriber, p.EventIDs)
}

// AttemptClose closes an open attempt on each event: it ended without an
// outcome worth counting.
func (s Store) AttemptClose(ctx context.Context, p CheckpointParams) error {
	return s.exec(ctx, attemptCloseSQL, p.Subscriber, p.EventIDs)
}

// AttemptFailParams is a failure of the handler on one event.
type AttemptFailParams struct {
	Subscriber string
	EventID    int64
	Error      string
	// Closing: the attempt was opened, and closes with the failure.
	Closing bool
}

// AttemptFail counts a failure of the handler on the event and returns its
// failures so far.
func (s Store) AttemptFail(ctx context.Context, p AttemptFailParams) (int, error) {
	closing := 0
	if p.Closing {
		closing = 1
	}
	var failures int
	err := s.db.QueryRow(ctx, attemptFailSQL, p.Subscriber, p.EventID, p.Error, closing).Scan(&failures)
	return failures, err
}

// AttemptDelete deletes the attempts rows of events done with.
func (s Store) AttemptDelete(ctx context.Context, p CheckpointParams) error {
	return s.exec(ctx, attemptDeleteSQL, p.Subscriber, p.EventIDs)
}

// AttemptPrune deletes up to 10,000 of the subscriber's attempts rows not
// touched for p.OlderThan (events long gone from the stream).
func (s Store) AttemptPrune(ctx context.Context, p PruneParams) error {
	return s.exec(ctx, attemptPruneSQL, p.Subscriber, p.OlderThan.Seconds())
}
