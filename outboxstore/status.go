package outboxstore

import (
	"context"
	"time"
)

// backlogSQL reads the unsent rows over the unsent index.
const backlogSQL = `
SELECT count(*) FILTER (WHERE status = 'pending'),
       count(*) FILTER (WHERE status = 'sending'),
       count(*) FILTER (WHERE status = 'failed'),
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)::float8
FROM outbox WHERE published_at IS NULL`

// Backlog is the outbox's unsent rows.
type Backlog struct {
	Pending, Sending, Failed int64
	// OldestPending is the age of the oldest pending row (0 if none).
	OldestPending time.Duration
}

// Backlog reads the unsent rows: cheap, over the unsent index (sent rows
// are not counted).
func (s *Store) Backlog(ctx context.Context) (Backlog, error) {
	var b Backlog
	var oldest float64
	err := s.pool.QueryRow(ctx, backlogSQL).Scan(&b.Pending, &b.Sending, &b.Failed, &oldest)
	b.OldestPending = time.Duration(oldest * float64(time.Second))
	return b, err
}

// Unsent counts the rows not marked sent (pending, sending, failed or
// skipped) among ids, or in the whole outbox if ids is nil: what a test
// or a benchmark waits on until a poll relay has published everything (a
// wal relay marks nothing sent).
func (s *Store) Unsent(ctx context.Context, ids []int64) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status <> 'sent' AND ($1::bigint[] IS NULL OR id = ANY($1))`, ids).Scan(&n)
	return n, err
}

// CountSent counts the sent rows still retained: a scan of the table.
func (s *Store) CountSent(ctx context.Context) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status = 'sent'`).Scan(&n)
	return n, err
}

// Held counts what failed rows hold back (relay.on_failed hold): the
// later events of their aggregates not yet published, and the aggregates.
// Driven by the failed rows, which are few.
func (s *Store) Held(ctx context.Context) (rows, aggregates int64, err error) {
	err = s.pool.QueryRow(ctx, `
WITH f AS (
    SELECT aggregate_type, aggregate_id, min(aggregate_seq) AS seq
    FROM outbox
    WHERE published_at IS NULL AND status = 'failed' AND aggregate_seq IS NOT NULL
    GROUP BY aggregate_type, aggregate_id
)
SELECT count(*), count(DISTINCT (p.aggregate_type, p.aggregate_id))
FROM f JOIN outbox p ON p.aggregate_type = f.aggregate_type AND p.aggregate_id = f.aggregate_id
WHERE p.aggregate_seq > f.seq AND num_nulls(p.published_at) = 1
  AND ((p.status IN ('pending', 'sending') AND $1 AND NOT EXISTS (SELECT FROM relay_capture))
       OR (p.status = 'failed' AND starts_with(p.last_error, $2)))`, s.OnFailed != SkipFailed, HeldBehindPrefix).Scan(&rows, &aggregates)
	return rows, aggregates, err
}

// RangeCounts says how many ranges the outbox holds, how many of them are
// sealed (full, waiting for their retention), and how many rows sit in
// outbox_default (rows no range holds).
func (s *Store) RangeCounts(ctx context.Context) (ranges, sealed int, defaultRows int64, err error) {
	err = s.pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM outbox_partitions), (SELECT count(*) FROM outbox_partitions WHERE sealed_at IS NOT NULL),
       (SELECT count(*) FROM outbox_default)`).Scan(&ranges, &sealed, &defaultRows)
	return ranges, sealed, defaultRows, err
}
