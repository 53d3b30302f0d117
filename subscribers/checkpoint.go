package subscribers

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Every statement on processed_events, the subscribers' checkpoint: one
// row per (subscriber, event) handled.
const (
	// checkpointSQL claims the batch's events in the checkpoint; RETURNING
	// names the ones not processed before. The ids are sorted, so two
	// transactions claiming overlapping batches lock in the same order.
	checkpointSQL = `
INSERT INTO processed_events (subscriber, event_id)
SELECT $1, id FROM unnest($2::bigint[]) AS id
ON CONFLICT DO NOTHING
RETURNING event_id`

	// recordSQL records events handled outside Postgres.
	recordSQL = `
INSERT INTO processed_events (subscriber, event_id)
SELECT $1, id FROM unnest($2::bigint[]) AS id
ON CONFLICT DO NOTHING`

	processedSQL = `SELECT event_id FROM processed_events WHERE subscriber = $1 AND event_id = ANY($2)`

	isProcessedSQL = `SELECT EXISTS (SELECT FROM processed_events WHERE subscriber = $1 AND event_id = $2)`

	countCheckpointsSQL = `SELECT subscriber, count(*) FROM processed_events GROUP BY subscriber`
)

// CountCheckpoints returns each subscriber's number of checkpoint rows.
func CountCheckpoints(ctx context.Context, pool *pgxpool.Pool) (map[string]int64, error) {
	counts, err := countBySubscriber(ctx, pool, countCheckpointsSQL)
	if err != nil {
		return nil, fmt.Errorf("count checkpoints: %w", err)
	}
	return counts, nil
}

// countBySubscriber runs a query of (subscriber, count) rows.
func countBySubscriber(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, sql string) (map[string]int64, error) {
	rows, err := q.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	counts := map[string]int64{}
	var name string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&name, &n}, func() error {
		counts[name] = n
		return nil
	})
	return counts, err
}

// pruneSQL deletes one batch of a subscriber's checkpoint rows older than the
// stream's max age: past it, the stream no longer holds the event, so it can
// never be delivered again.
const pruneSQL = `
DELETE FROM processed_events
WHERE subscriber = $1 AND event_id IN (
    SELECT event_id FROM processed_events
    WHERE subscriber = $1 AND processed_at < now() - make_interval(secs => $2::float8)
    LIMIT 5000
)`

// pruneInterval is how often each instance prunes (with jitter).
const pruneInterval = 10 * time.Minute

func (r *Runner) pruneLoop(ctx context.Context) {
	for {
		wait := pruneInterval/2 + rand.N(pruneInterval)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if n, err := r.Prune(ctx); err != nil && ctx.Err() == nil {
			r.logger.Warn("prune checkpoint", "error", err)
		} else if n > 0 {
			r.logger.Info("pruned checkpoint", "rows", n)
		}
	}
}

// Prune deletes the subscriber's checkpoint rows older than the stream's
// max age and returns how many.
func (r *Runner) Prune(ctx context.Context) (int64, error) {
	var total int64
	for ctx.Err() == nil {
		ct, err := r.opts.Pool.Exec(ctx, pruneSQL, r.name, r.opts.Stream.MaxAge.Seconds())
		if err != nil {
			return total, err
		}
		total += ct.RowsAffected()
		if ct.RowsAffected() < 5000 {
			break
		}
	}
	// Attempt rows of events long gone from the stream (one whose event was
	// neither handled nor dead-lettered: its consumer was reset).
	if _, err := r.opts.Pool.Exec(ctx, pruneAttemptsSQL, r.name, r.opts.Stream.MaxAge.Seconds()); err != nil {
		return total, err
	}
	return total, ctx.Err()
}
