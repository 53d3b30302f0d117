package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// claimSQL moves up to $1 pending rows to `sending` under lease token $2.
//
// The ids are picked in a CTE, and the UPDATE joins on them: with
// `UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)` the
// planner may run the sub-select more than once (as a semi-join re-scan) and
// return more than n rows. SKIP LOCKED lets several relays claim disjoint
// batches without waiting on each other. The walk is over outbox_unsent_idx
// (published_at IS NULL) in id order; rows being sent, backing off
// (available_at in the future) or failed are filtered on the way. The update
// touches no indexed column, so it is HOT (see the schema).
//
// EXPLAIN (200k pending rows, batch 500):
//
//	Update on outbox o
//	  CTE picked
//	    ->  Limit
//	          ->  LockRows
//	                ->  Index Scan using outbox_unsent_idx on outbox
//	                      Filter: ((status = 'pending') AND (available_at <= now()))
//	  ->  Nested Loop
//	        ->  CTE Scan on picked
//	        ->  Index Scan using outbox_pkey on outbox o
//	              Index Cond: (id = picked.id)
const claimSQL = `
WITH picked AS (
    SELECT id
    FROM outbox
    WHERE published_at IS NULL AND status = 'pending' AND available_at <= now()
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET status = 'sending', claimed_at = now(), lease_token = $2
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.created_at`

func (r *Relay) claim(ctx context.Context) ([]row, pgtype.UUID, error) {
	token := newLeaseToken()
	rows, err := r.pool.Query(ctx, claimSQL, r.cfg.BatchSize, token)
	if err != nil {
		return nil, token, fmt.Errorf("claim outbox batch: %w", err)
	}
	// Every column is read into a type that holds any value the schema
	// allows (jsonb as raw bytes, created_at with its infinities), and
	// nothing is decoded here. The rows are `sending` already: a row that
	// failed to decode would fail the whole claim, come back after its
	// lease, and be claimed again with the same neighbours, forever.
	// message() judges each row on its own, and a bad row becomes `failed`.
	claimed, err := pgx.CollectRows(rows, func(rows pgx.CollectableRow) (row, error) {
		var rw row
		err := rows.Scan(&rw.id, &rw.aggregateType, &rw.aggregateID, &rw.eventType, &rw.payload, &rw.headers, &rw.createdAt)
		return rw, err
	})
	if err != nil {
		return nil, token, fmt.Errorf("claim outbox batch: %w", err)
	}
	sortRows(claimed)
	return claimed, token, nil
}

// The three ways a claimed row leaves `sending`. Each requires the row's
// lease token: a relay whose lease expired (and whose rows another relay
// claimed since) changes nothing.
const (
	markSentSQL = `
UPDATE outbox
SET status = 'sent', published_at = now(), last_error = NULL
WHERE id = ANY($1) AND status = 'sending' AND lease_token = $2`

	// Backoff: retry_min * 2^attempts, capped at retry_max.
	markRetrySQL = `
UPDATE outbox o
SET status = 'pending',
    attempts = o.attempts + 1,
    last_error = f.reason,
    available_at = now() + make_interval(secs => least($4::float8, $3::float8 * power(2, least(o.attempts, 30)))),
    claimed_at = NULL,
    lease_token = NULL
FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
WHERE o.id = f.id AND o.status = 'sending' AND o.lease_token = $5`

	markFailedSQL = `
UPDATE outbox o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.reason
FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
WHERE o.id = f.id AND o.status = 'sending' AND o.lease_token = $3`
)

// record writes the batch's outcomes in one transaction, retrying while
// Postgres is unreachable (a restart, a failover) for up to half the lease.
// If it still cannot, the rows stay `sending` and the reaper returns them;
// their second publish is dropped by JetStream as a duplicate.
func (r *Relay) record(ctx context.Context, rows []row, token pgtype.UUID, results []outcome) {
	var sentIDs, retryIDs, failedIDs []int64
	var retryReasons, failedReasons []string
	var published []Published
	for i, res := range results {
		id := rows[i].id
		switch {
		case res.acked:
			sentIDs = append(sentIDs, id)
			published = append(published, Published{ID: id, CreatedAt: rows[i].createdAt.Time, AckedAt: res.ackedAt, Duplicate: res.duplicate})
		case res.permanent:
			failedIDs = append(failedIDs, id)
			failedReasons = append(failedReasons, res.err)
		default:
			retryIDs = append(retryIDs, id)
			retryReasons = append(retryReasons, res.err)
		}
	}

	var sent int64
	op := func() (struct{}, error) {
		err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			if len(sentIDs) > 0 {
				b.Queue(markSentSQL, sentIDs, token).Exec(func(ct pgconn.CommandTag) error {
					sent = ct.RowsAffected()
					return nil
				})
			}
			if len(retryIDs) > 0 {
				b.Queue(markRetrySQL, retryIDs, retryReasons, r.cfg.RetryMin.Seconds(), r.cfg.RetryMax.Seconds(), token)
			}
			if len(failedIDs) > 0 {
				b.Queue(markFailedSQL, failedIDs, failedReasons, token)
			}
			return tx.SendBatch(ctx, b).Close()
		})
		if err != nil && ctx.Err() != nil {
			return struct{}{}, backoff.Permanent(err)
		}
		return struct{}{}, err
	}
	_, err := backoff.Retry(ctx, op,
		backoff.WithBackOff(&backoff.ExponentialBackOff{
			InitialInterval: 50 * time.Millisecond, RandomizationFactor: 0.3, Multiplier: 2, MaxInterval: 2 * time.Second,
		}),
		backoff.WithMaxElapsedTime(r.cfg.Lease/2),
		backoff.WithNotify(func(err error, next time.Duration) {
			r.logger.Warn("record published batch, will retry", "error", err, "retry_in", next, "rows", len(rows))
		}))
	if err != nil {
		r.logger.Error("record published batch: giving up; the reaper will return the rows after their lease",
			"error", err, "rows", len(rows), "first_id", rows[0].id)
		return
	}
	if int(sent) < len(sentIDs) {
		// Another relay holds these rows now (our lease expired); it will
		// publish them again and JetStream will drop the duplicate.
		r.logger.Warn("lease lost before marking sent", "rows", len(sentIDs)-int(sent))
	}
	if len(published) > 0 {
		r.obs.Published(published)
		dups := 0
		for _, p := range published {
			if p.Duplicate {
				dups++
			}
		}
		r.logger.Debug("batch recorded", "sent", len(published), "duplicates", dups, "retried", len(retryIDs), "failed", len(failedIDs))
	}
	if len(retryIDs) > 0 {
		r.obs.Retried(len(retryIDs))
		r.logger.Warn("publish failed, rows will be retried", "rows", len(retryIDs), "first_id", retryIDs[0], "error", retryReasons[0])
	}
	if len(failedIDs) > 0 {
		r.obs.Failed(len(failedIDs))
		for i, id := range failedIDs {
			r.logger.Error("outbox row can never be published: marked failed", "event_id", id, "reason", failedReasons[i])
		}
	}
}
