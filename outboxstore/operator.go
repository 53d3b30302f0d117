package outboxstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// RetryFailed returns every failed row to pending, its attempts reset and
// its last error kept behind a note that an operator retried it.
//
// The rows go back one per aggregate per statement, in each aggregate's
// order (waves, in one transaction): a wal relay decodes the statements in
// that order, and so publishes an aggregate's returned events in theirs.
func (s *Store) RetryFailed(ctx context.Context) (int64, error) {
	return s.returnFailed(ctx, `published_at IS NULL AND status = 'failed'`, nil, "retried by an operator after: ")
}

// returnFailed returns the failed rows that where (with its args from
// $2 on) picks to pending, in waves (see RetryFailed), noting why before
// each one's last error.
func (s *Store) returnFailed(ctx context.Context, where string, args []any, note string) (int64, error) {
	var n int64
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var err error
		n, err = returnFailedTx(ctx, tx, where, args, note)
		return err
	})
	return n, err
}

func returnFailedTx(ctx context.Context, tx pgx.Tx, where string, args []any, note string) (int64, error) {
	var n int64
	for {
		ct, err := tx.Exec(ctx, `
UPDATE outbox
SET status = 'pending', attempts = 0, available_at = now(), claimed_at = NULL, lease_token = NULL,
    last_error = $1 || coalesce(last_error, '')
WHERE id IN (SELECT DISTINCT ON (aggregate_type, aggregate_id) id FROM outbox
             WHERE `+where+`
             ORDER BY aggregate_type, aggregate_id, aggregate_seq NULLS FIRST, id)`, append([]any{note}, args...)...)
		if err != nil {
			return n, err
		}
		if ct.RowsAffected() == 0 {
			return n, nil
		}
		n += ct.RowsAffected()
	}
}

// Skipped is a failed row an operator skipped.
type Skipped struct {
	ID       int64
	Released int64 // the later events of its aggregate returned to the relays with it
}

// Skip marks failed rows skipped: they will never be published, and they
// no longer hold the later events of their aggregates (relay.on_failed
// hold). The later events a wal relay had marked failed behind one (see
// HeldBehindPrefix) go back to pending, in order. Ids that name no failed
// row are left out of the result.
func (s *Store) Skip(ctx context.Context, ids []int64) ([]Skipped, error) {
	var skipped []Skipped
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		skipped = skipped[:0]
		rows, err := tx.Query(ctx, `
UPDATE outbox
SET status = 'skipped', last_error = 'skipped by an operator after: ' || coalesce(last_error, '')
WHERE id = ANY($1) AND published_at IS NULL AND status = 'failed'
RETURNING id`, ids)
		if err != nil {
			return err
		}
		done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return err
		}
		for _, id := range done {
			held := HeldBehindPrefix + strconv.FormatInt(id, 10) + ","
			n, err := returnFailedTx(ctx, tx, `published_at IS NULL AND status = 'failed' AND starts_with(last_error, $2)`,
				[]any{held}, "released when an operator skipped the event it was held behind: ")
			if err != nil {
				return err
			}
			skipped = append(skipped, Skipped{ID: id, Released: n})
		}
		return nil
	})
	return skipped, err
}

// Republish returns the rows published at or after since to pending, and
// says when the oldest published row still retained was published (nil if
// none): events published before it are no longer in the outbox.
//
// While a wal relay's slot exists (a relay_capture row), it covers the
// rows the wal relay published as well: they stay pending in the table,
// with no publish time, and are taken by created_at (when their writer's
// transaction began, a moment before the slot decoded them); the update
// that returns them is what the wal relay decodes and publishes again.
// The capture mode is read from the database, not from the caller's
// configuration, which may not be the relays'.
func (s *Store) Republish(ctx context.Context, since time.Time) (n int64, oldestRetained *time.Time, err error) {
	var captured bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM relay_capture)`).Scan(&captured); err != nil {
		return 0, nil, err
	}
	if err := s.pool.QueryRow(ctx, `
SELECT least(min(published_at) FILTER (WHERE status = 'sent'),
             min(created_at) FILTER (WHERE $1 AND status = 'pending' AND published_at IS NULL))
FROM outbox`, captured).Scan(&oldestRetained); err != nil {
		return 0, nil, err
	}
	ct, err := s.pool.Exec(ctx, `
UPDATE outbox
SET status = 'pending', published_at = NULL, available_at = now(), claimed_at = NULL, lease_token = NULL,
    last_error = 'republished by an operator'
WHERE (status = 'sent' AND published_at >= $1)
   OR ($2 AND status = 'pending' AND published_at IS NULL AND created_at >= $1)`, since, captured)
	return ct.RowsAffected(), oldestRetained, err
}

// Event reads the row of event id as a claim would return it, whatever its
// status; found is false when the outbox no longer holds it (retention
// dropped its range). Postgres is the truth about an event: the operator
// tools redrive from this row while it exists.
func (s *Store) Event(ctx context.Context, id int64) (row Claimed, found bool, err error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, aggregate_seq
FROM outbox WHERE id = $1`, id)
	if err != nil {
		return Claimed{}, false, fmt.Errorf("read outbox row %d: %w", id, err)
	}
	row, err = pgx.CollectExactlyOneRow(rows, scanClaimed)
	if errors.Is(err, pgx.ErrNoRows) {
		return Claimed{}, false, nil
	}
	if err != nil {
		return Claimed{}, false, fmt.Errorf("read outbox row %d: %w", id, err)
	}
	return row, true, nil
}
