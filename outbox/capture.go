package outbox

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

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

// UnsentThrough counts the rows with ids up to maxID that are still to be
// published (pending or sending; failed rows wait for an operator).
//
// With failed rows holding their aggregates (OnFailed hold), the rows held
// behind one are not counted: MarkHeldThrough marks them.
func (s *Store) UnsentThrough(ctx context.Context, maxID int64) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `
SELECT count(*) FROM outbox o
WHERE published_at IS NULL AND status IN ('pending', 'sending') AND id <= $1
  AND NOT ($2 AND EXISTS (
      SELECT FROM outbox f
      WHERE f.aggregate_type = o.aggregate_type AND f.aggregate_id = o.aggregate_id
        AND f.aggregate_seq < o.aggregate_seq AND num_nulls(f.published_at) = 1 AND f.status = 'failed'))`,
		maxID, s.OnFailed != SkipFailed).Scan(&n)
	return n, err
}

// MarkHeldThrough marks failed (HeldBehindReason) the pending rows with ids
// up to maxID held behind a failed row of their aggregate: a wal relay's
// backlog leaves them so, and an operator's retry-failed or skip then
// returns them through the slot, in order.
func (s *Store) MarkHeldThrough(ctx context.Context, maxID int64) (int64, error) {
	ct, err := s.pool.Exec(ctx, `
UPDATE outbox o
SET status = 'failed', last_error = $2 || h.failed_id || $3
FROM (
    SELECT p.id, (SELECT min(f.id) FROM outbox f
                  WHERE f.aggregate_type = p.aggregate_type AND f.aggregate_id = p.aggregate_id
                    AND f.aggregate_seq < p.aggregate_seq AND num_nulls(f.published_at) = 1 AND f.status = 'failed') AS failed_id
    FROM outbox p
    WHERE p.published_at IS NULL AND p.status = 'pending' AND p.id <= $1
) h
WHERE o.id = h.id AND h.failed_id IS NOT NULL AND o.status = 'pending' AND o.published_at IS NULL`,
		maxID, HeldBehindPrefix, strings.TrimPrefix(HeldBehindReason(0), HeldBehindPrefix+"0"))
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
