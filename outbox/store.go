package outbox

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Store holds every query on the outbox table besides the writers' own
// inserts (Write, Queue): the relay's claim, marks, reaping and clean-up,
// and what status, the metrics and the operator commands read and change.
// A role needs only the grants of the methods it calls (see
// deploy/postgres/roles.sql).
type Store struct{ pool *pgxpool.Pool }

// NewStore returns the outbox queries over pool.
func NewStore(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

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
// The walk starts above $4. Every sent row leaves an entry in the index
// that only vacuum removes, and none can while a snapshot older than the
// row is open (a long report, a stuck session): a walk from the lowest id
// then steps over every event published since, and a relay that starts
// most of its claims from a recent floor does not (package relay).
//
// EXPLAIN (200k pending rows, batch 500):
//
//	Update on outbox o
//	  CTE picked
//	    ->  Limit
//	          ->  LockRows
//	                ->  Index Scan using outbox_unsent_idx on outbox
//	                      Index Cond: ((id > $4) AND (id <= $3))
//	                      Filter: ((status = 'pending') AND (available_at <= now()))
//	  ->  Nested Loop
//	        ->  CTE Scan on picked
//	        ->  Index Scan using outbox_pkey on outbox o
//	              Index Cond: (id = picked.id)
const claimSQL = `
WITH picked AS (
    SELECT id
    FROM outbox
    WHERE published_at IS NULL AND status = 'pending' AND available_at <= now() AND id > $4 AND id <= $3
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET status = 'sending', claimed_at = now(), lease_token = $2
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.created_at`

// Claimed is a row the relay claimed. Every column is read into a type
// that holds any value the schema allows (jsonb as raw bytes, created_at
// with its infinities), and nothing is decoded: a row that failed to
// decode would fail the whole claim, come back after its lease, and be
// claimed again with the same neighbours, forever. The relay judges each
// row on its own.
type Claimed struct {
	ID            int64
	AggregateType string
	AggregateID   string
	EventType     string
	Payload       []byte
	Headers       []byte // the jsonb column as text
	CreatedAt     pgtype.Timestamptz
}

// Claim moves up to n pending rows that are due to `sending` under the
// lease token, and returns them in the order they were picked.
func (s *Store) Claim(ctx context.Context, n int, token pgtype.UUID) ([]Claimed, error) {
	return s.ClaimRange(ctx, n, token, math.MinInt64, math.MaxInt64)
}

// ClaimThrough is Claim of rows with ids up to maxID only.
func (s *Store) ClaimThrough(ctx context.Context, n int, token pgtype.UUID, maxID int64) ([]Claimed, error) {
	return s.ClaimRange(ctx, n, token, math.MinInt64, maxID)
}

// ClaimRange is Claim of rows with ids above after and up to through.
func (s *Store) ClaimRange(ctx context.Context, n int, token pgtype.UUID, after, through int64) ([]Claimed, error) {
	rows, err := s.pool.Query(ctx, claimSQL, n, token, through, after)
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	claimed, err := pgx.CollectRows(rows, scanClaimed)
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	return claimed, nil
}

// Unpublished reads the rows among ids that are pending and unpublished,
// as a claim would return them, without claiming them.
func (s *Store) Unpublished(ctx context.Context, ids []int64) ([]Claimed, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, created_at
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

func scanClaimed(rows pgx.CollectableRow) (Claimed, error) {
	var c Claimed
	err := rows.Scan(&c.ID, &c.AggregateType, &c.AggregateID, &c.EventType, &c.Payload, &c.Headers, &c.CreatedAt)
	return c, err
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
}

// Record marks a batch's outcomes in one transaction, for the rows still
// under token, and returns how many were marked sent (fewer than
// len(o.Sent) when the lease was lost).
func (s *Store) Record(ctx context.Context, token pgtype.UUID, o Outcomes) (sent int64, err error) {
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
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
		return tx.SendBatch(ctx, b).Close()
	})
	return sent, err
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

// deleteSentSQL deletes one small batch of sent rows past their retention
// from outbox_default, the rows no range holds (see the schema): the
// ranges themselves are dropped whole (RetirePartition). Small batches
// keep each transaction short and the table from bloating. Old sent rows
// hold the lowest ids, so the walk up the primary key finds them first
// (there is no index on status = 'sent').
const deleteSentSQL = `
DELETE FROM outbox_default
WHERE id IN (
    SELECT id
    FROM outbox_default
    WHERE status = 'sent' AND published_at < now() - make_interval(secs => $1::float8)
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)`

// DeleteSent deletes up to batch sent rows of outbox_default published
// longer than retention ago.
func (s *Store) DeleteSent(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	ct, err := s.pool.Exec(ctx, deleteSentSQL, retention.Seconds(), batch)
	return ct.RowsAffected(), err
}

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

// CountSent counts the sent rows still retained: a scan of the table.
func (s *Store) CountSent(ctx context.Context) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status = 'sent'`).Scan(&n)
	return n, err
}

// RetryFailed returns every failed row to pending, its attempts reset and
// its last error kept behind a note that an operator retried it.
func (s *Store) RetryFailed(ctx context.Context) (int64, error) {
	ct, err := s.pool.Exec(ctx, `
UPDATE outbox
SET status = 'pending', attempts = 0, available_at = now(), claimed_at = NULL, lease_token = NULL,
    last_error = 'retried by an operator after: ' || coalesce(last_error, '')
WHERE published_at IS NULL AND status = 'failed'`)
	return ct.RowsAffected(), err
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

// UnsentThrough counts the rows with ids up to maxID that are still to be
// published (pending or sending; failed rows wait for an operator).
func (s *Store) UnsentThrough(ctx context.Context, maxID int64) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `
SELECT count(*) FROM outbox
WHERE published_at IS NULL AND status IN ('pending', 'sending') AND id <= $1`, maxID).Scan(&n)
	return n, err
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

// deleteCapturedSQL deletes one small batch of rows of outbox_default that
// a wal relay captured (they stay pending in the table) past their
// retention; $3 is the slot's backlog bound: rows at or below it may still
// be waiting for the claim. A row an operator returned to the relays
// (available_at is then) counts from that moment: it may be old, and not
// yet published again.
const deleteCapturedSQL = `
DELETE FROM outbox_default
WHERE id IN (
    SELECT id
    FROM outbox_default
    WHERE published_at IS NULL AND status = 'pending' AND id > $3
      AND greatest(created_at, available_at) < now() - make_interval(secs => $1::float8)
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)`

// DeleteCaptured deletes up to batch captured rows of outbox_default (ids
// above backlogThrough) created longer than retention ago.
func (s *Store) DeleteCaptured(ctx context.Context, retention time.Duration, batch int, backlogThrough int64) (int64, error) {
	ct, err := s.pool.Exec(ctx, deleteCapturedSQL, retention.Seconds(), batch, backlogThrough)
	return ct.RowsAffected(), err
}

// Partition is one range of outbox ids (schema migration 00008): the
// relays add them ahead of the identity and drop them past retention.
type Partition struct {
	Name string
	// Lower is the range's first id; nil for the range holding every id
	// below the first (outbox_legacy).
	Lower *int64
	// Upper is the first id past the range.
	Upper int64
	// SealedAt is when every id of the range was handed out and committed
	// (nil before).
	SealedAt *time.Time
}

// Partitions lists the ranges, lowest first.
func (s *Store) Partitions(ctx context.Context) ([]Partition, error) {
	rows, err := s.pool.Query(ctx, `SELECT name, lower_id, upper_id, sealed_at FROM outbox_partitions ORDER BY upper_id`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Partition, error) {
		var p Partition
		err := row.Scan(&p.Name, &p.Lower, &p.Upper, &p.SealedAt)
		return p, err
	})
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

// ExtendPartitions adds ranges of span ids until ahead of them lie beyond
// the next id, and returns the names of those it added. When the ids have
// come within margin of the last range's end, the next range starts margin
// above the next id (see fanout_outbox_extend in the schema).
func (s *Store) ExtendPartitions(ctx context.Context, span int64, ahead int, margin int64) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT fanout_outbox_extend($1, $2, $3)`, span, ahead, margin)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// SealPartition seals a range whose ids were all handed out, once no
// transaction inserts into it any more; it says whether it did.
func (s *Store) SealPartition(ctx context.Context, name string) (bool, error) {
	var sealed bool
	err := s.pool.QueryRow(ctx, `SELECT fanout_outbox_seal($1)`, name).Scan(&sealed)
	return sealed, err
}

// Retirement is what decides whether a sealed range may be dropped.
type Retirement struct {
	// Retention is how long after its last row was published a range is
	// kept (relay.sent_retention).
	Retention time.Duration
	// Captured says the relays capture from the WAL: their rows stay
	// pending, and a range is published once the slot confirmed past it.
	Captured bool
	// ConfirmedLSN is the slot's confirmed position (wal capture; "" when
	// unknown, and then no range is dropped).
	ConfirmedLSN string
	// BacklogThrough is the slot's backlog bound while its backlog is
	// being claimed (math.MinInt64 once done): a pending row at or below
	// it is still to be published.
	BacklogThrough int64
}

// RetirePartition drops a sealed range whose rows were all published
// longer than the retention ago, moving its failed rows to outbox_default.
// When it does not, reason says why (the range is not yet due, or rows in
// it are still to be published).
func (s *Store) RetirePartition(ctx context.Context, name string, r Retirement) (retired bool, moved int64, reason string, err error) {
	var confirmed *string
	if r.ConfirmedLSN != "" {
		confirmed = &r.ConfirmedLSN
	}
	var why *string
	err = s.pool.QueryRow(ctx, `SELECT retired, moved, reason FROM fanout_outbox_retire($1, make_interval(secs => $2::float8), $3, $4::pg_lsn, $5)`,
		name, r.Retention.Seconds(), r.Captured, confirmed, r.BacklogThrough).Scan(&retired, &moved, &why)
	if why != nil {
		reason = *why
	}
	return retired, moved, reason, err
}
