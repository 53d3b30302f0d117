package outboxstore

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The ways a claimed row leaves `sending`. Each requires the row's
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

	// Returned rows were claimed and not published (an earlier event of
	// their aggregate in the same batch was not): back to pending as they
	// were, no attempt counted.
	markReturnedSQL = `
UPDATE outbox
SET status = 'pending', claimed_at = NULL, lease_token = NULL
WHERE id = ANY($1) AND status = 'sending' AND lease_token = $2`

	markFailedSQL = `
UPDATE outbox o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.reason
FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
WHERE o.id = f.id AND o.status = 'sending' AND o.lease_token = $3`
)

// Outcomes are what became of a claimed batch's rows.
type Outcomes struct {
	Sent []int64
	// Retry rows go back to pending after a backoff of RetryMin doubled
	// per attempt, capped at RetryMax; RetryReasons say why, in order.
	Retry              []int64
	RetryReasons       []string
	RetryMin, RetryMax time.Duration
	// Failed rows can never be published; FailedReasons say why.
	Failed        []int64
	FailedReasons []string
	// Returned rows go back to pending unpublished, no attempt counted.
	Returned []int64
	// Landed is where the published rows landed in Stream (the stream
	// sequence of each PubAck), recorded with them for the auditor.
	Landed []Landed
	Stream string
	// Next, if set, claims in the same transaction the next events of the
	// aggregates of Next.Published, as ClaimNext: a relay goes on with an
	// aggregate's backlog for the price of one round trip.
	Next *NextClaim
}

// NextClaim is a ClaimNext made with a Record.
type NextClaim struct {
	Published []Claimed // the last row published of each aggregate
	Token     pgtype.UUID
	Depth, N  int
}

// Record marks a batch's outcomes in one transaction, for the rows still
// under token, and returns how many were marked sent (fewer than
// len(o.Sent) when the lease was lost) and the rows o.Next claimed.
//
// The statements go in one round trip, as one implicit transaction (a
// batch without BEGIN): a failed one rolls back the others.
func (s *Store) Record(ctx context.Context, token pgtype.UUID, o Outcomes) (sent int64, next []Claimed, err error) {
	b := &pgx.Batch{}
	if len(o.Sent) > 0 {
		b.Queue(markSentSQL, o.Sent, token).Exec(func(ct pgconn.CommandTag) error {
			sent = ct.RowsAffected()
			return nil
		})
	}
	if len(o.Retry) > 0 {
		b.Queue(markRetrySQL, o.Retry, o.RetryReasons, o.RetryMin.Seconds(), o.RetryMax.Seconds(), token)
	}
	if len(o.Failed) > 0 {
		b.Queue(markFailedSQL, o.Failed, o.FailedReasons, token)
	}
	if len(o.Returned) > 0 {
		b.Queue(markReturnedSQL, o.Returned, token)
	}
	if len(o.Landed) > 0 {
		b.Queue(insertLandingsSQL, landingArgs(o.Stream, o.Landed)...)
	}
	if o.Next != nil {
		if args := nextClaimArgs(o.Next.Published, o.Next.Token, o.Next.Depth, o.Next.N); args != nil {
			b.Queue(claimNextSQL, args...).Query(func(rows pgx.Rows) (err error) {
				next, err = pgx.CollectRows(rows, scanClaimed)
				return err
			})
		}
	}
	if b.Len() == 0 {
		return 0, nil, nil
	}
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return 0, nil, err
	}
	return sent, next, nil
}

// reapSQL returns rows whose lease expired to `pending`. Their relay died or
// stalled after claiming them; whether it published them or not, publishing
// again is safe (JetStream drops the duplicate within its window).
const reapSQL = `
WITH expired AS (
    SELECT id
    FROM outbox
    WHERE published_at IS NULL AND status = 'sending' AND claimed_at < now() - make_interval(secs => $1::float8)
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET status = 'pending', claimed_at = NULL, lease_token = NULL,
    last_error = 'lease expired: its relay died or stalled before recording the publish'
FROM expired
WHERE o.id = expired.id`

// Reap returns up to 1000 rows claimed longer than lease ago to pending.
func (s *Store) Reap(ctx context.Context, lease time.Duration) (int64, error) {
	ct, err := s.pool.Exec(ctx, reapSQL, lease.Seconds())
	return ct.RowsAffected(), err
}
