package outbox

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
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
type Store struct {
	pool *pgxpool.Pool
	// OnFailed says whether a failed row holds its aggregate's later
	// events (HoldFailed, the default) or lets them pass (SkipFailed). Set
	// it before the Store is used.
	OnFailed OnFailed
	// Unordered claims without per-aggregate order, for the self-test of
	// the checkers that must catch events out of order (internal/testhooks).
	Unordered bool
}

// OnFailed is what a failed row does to the later events of its aggregate
// (relay.on_failed).
type OnFailed string

const (
	// HoldFailed keeps an aggregate's later events unpublished while an
	// earlier one is failed, until an operator returns it (outbox
	// retry-failed) or skips it (outbox skip).
	HoldFailed OnFailed = "hold"
	// SkipFailed publishes an aggregate's later events past a failed one.
	SkipFailed OnFailed = "skip"
)

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
//
// Per-aggregate order: a row is claimed only when no earlier event of its
// aggregate (a lower aggregate_seq) is still unpublished: pending, backing
// off, claimed by this or another relay, or failed while $5 (hold): a row
// an operator skipped (status skipped) never holds. So an aggregate has at most one event in flight, and
// its events enter the stream in their order whatever the relays do: a
// publish retried after a backoff, a lease expired, a relay killed
// mid-batch (the row comes back and still goes first). An earlier row
// claimed by a transaction not yet committed is still pending to this
// one's snapshot, so two relays claiming at once cannot both take an
// aggregate's consecutive events. The check is a probe of
// outbox_aggregate_unsent_idx per candidate; rows without a number
// (written before migration 00009) are not ordered.
const claimSQL = `
WITH picked AS (
    SELECT o.id
    FROM outbox o
    WHERE o.published_at IS NULL AND o.status = 'pending' AND o.available_at <= now() AND o.id > $4 AND o.id <= $3
      AND ` + headOfAggregate + `
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE outbox o
SET status = 'sending', claimed_at = now(), lease_token = $2
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.created_at, o.aggregate_seq`

// headOfAggregate holds for a row o (claimSQL) when no earlier event of
// its aggregate is still to be published; $5 is whether failed rows hold.
//
// It looks at the event just before o (aggregate_seq - 1) only. The
// numbers have no gaps (the trigger of migration 00009 gives them out;
// fanout_writer may not set them), and an event is published only once
// the one before it is (this check, applied to that one), so the event
// before o being published, skipped or failed under relay.on_failed skip
// says the same of every earlier one. A probe of the numbers below o
// would also step over the entry of every event of the aggregate
// published since the oldest snapshot still open (a long report, a stuck
// session): vacuum may not remove them, and each costs a visit to the
// table. The probe of one number visits one entry however long the
// aggregate's history.
//
// It is a probe of outbox_aggregate_unsent_idx per row, and must stay one:
// num_nulls(e.published_at) = 1, not published_at IS NULL, keeps the
// planner off outbox_unsent_idx (migration 00013), and OFFSET 0 keeps it
// from turning the probes into one scan of the whole index for all the
// rows. Both indexes look empty to the planner, and under a held snapshot
// both hold an entry for every row published since.
const headOfAggregate = `NOT EXISTS (
          SELECT FROM outbox e
          WHERE e.aggregate_type = o.aggregate_type AND e.aggregate_id = o.aggregate_id
            AND e.aggregate_seq = o.aggregate_seq - 1 AND num_nulls(e.published_at) = 1
            AND (e.status IN ('pending', 'sending') OR (e.status = 'failed' AND $5))
          OFFSET 0)`

// claimNextSQL claims, for each aggregate in $1..$3 (types, ids, and the
// number just published), its next events: up to $5 in a row from the
// number after, stopping at the first that is not pending and due or that
// another relay holds (a run must have no hole: the relay publishes it in
// order). At most $6 rows in all, the aggregates' next events first.
// Their predecessor was just published, and the ones before it before
// it, so no other check is needed. Each aggregate is a probe of
// outbox_aggregate_unsent_idx of its own, as in headOfAggregate (LIMIT
// keeps the probes apart).
const claimNextSQL = `
WITH candidates AS (
    SELECT n.id, n.aggregate_type, n.aggregate_id, n.pos
    FROM unnest($1::text[], $2::text[], $3::bigint[]) AS p(aggregate_type, aggregate_id, seq)
    CROSS JOIN LATERAL (
        SELECT e.id, e.aggregate_type, e.aggregate_id, e.aggregate_seq - p.seq AS pos
        FROM outbox e
        WHERE e.aggregate_type = p.aggregate_type AND e.aggregate_id = p.aggregate_id
          AND e.aggregate_seq > p.seq AND e.aggregate_seq <= p.seq + $5 AND num_nulls(e.published_at) = 1
          AND e.status = 'pending' AND e.available_at <= now()
        ORDER BY e.aggregate_seq
        LIMIT $5
        FOR UPDATE OF e SKIP LOCKED
    ) n
), runs AS (
    SELECT id, pos, row_number() OVER (PARTITION BY aggregate_type, aggregate_id ORDER BY pos) AS rn
    FROM candidates
), picked AS (
    SELECT id FROM runs WHERE pos = rn ORDER BY pos, id LIMIT $6
)
UPDATE outbox o
SET status = 'sending', claimed_at = now(), lease_token = $4
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.created_at, o.aggregate_seq`

// ClaimNext claims, under the lease token, the next events of each
// aggregate of published (rows just marked sent, with their numbers): up
// to depth in a row per aggregate and n in all. Each became claimable as
// the one before was published, and a relay that claims them at once (and
// publishes them in order, a wave at a time) keeps a busy aggregate's
// events moving at the pace of a publish, not of the claims (package
// relay).
func (s *Store) ClaimNext(ctx context.Context, published []Claimed, token pgtype.UUID, depth, n int) ([]Claimed, error) {
	args := nextClaimArgs(published, token, depth, n)
	if args == nil {
		return nil, nil
	}
	rows, err := s.pool.Query(ctx, claimNextSQL, args...)
	if err != nil {
		return nil, fmt.Errorf("claim the next events of published aggregates: %w", err)
	}
	claimed, err := pgx.CollectRows(rows, scanClaimed)
	if err != nil {
		return nil, fmt.Errorf("claim the next events of published aggregates: %w", err)
	}
	return claimed, nil
}

// nextClaimArgs are claimNextSQL's arguments, or nil if there is nothing
// to claim.
func nextClaimArgs(published []Claimed, token pgtype.UUID, depth, n int) []any {
	var types, ids []string
	var seqs []int64
	for _, c := range published {
		if c.AggregateSeq.Valid {
			types, ids, seqs = append(types, c.AggregateType), append(ids, c.AggregateID), append(seqs, c.AggregateSeq.Int64)
		}
	}
	if len(seqs) == 0 || n < 1 {
		return nil
	}
	return []any{types, ids, seqs, token, max(depth, 1), n}
}

// claimUnorderedSQL is claimSQL without the per-aggregate check, which
// the relay's test hooks break on purpose.
var claimUnorderedSQL = func() string {
	return strings.Replace(claimSQL, headOfAggregate, "$5::boolean IS NOT NULL", 1)
}()

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
	// AggregateSeq is the event's number within its aggregate; not valid
	// for a row written before schema migration 00009.
	AggregateSeq pgtype.Int8
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
	query := claimSQL
	if s.Unordered {
		query = claimUnorderedSQL
	}
	rows, err := s.pool.Query(ctx, query, n, token, through, after, s.OnFailed != SkipFailed)
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	claimed, err := pgx.CollectRows(rows, scanClaimed)
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	return claimed, nil
}

// ClaimWindow is what the relay's claim loop and sweeper claim with: up to
// n due heads (as ClaimRange) among the first window unpublished rows
// above after and up to through, oldest first, so that a claim's walk is
// bounded however large the backlog of events waiting for the one before
// them. It also reports the newest id in the outbox as the claim began
// and whether the window was full (more unpublished rows lie up to
// through). A claim that returns fewer than n rows looked at every row of
// the window, or up to the newest id if the window was not full, whose
// transaction had committed. It is one statement, which finds the
// window's end once: under a held snapshot every walk over the index
// steps over the entries of every row published since.
func (s *Store) ClaimWindow(ctx context.Context, n int, token pgtype.UUID, after, through int64, window int) (Window, error) {
	query := claimWindowSQL
	if s.Unordered {
		query = claimUnorderedWindowSQL
	}
	rows, err := s.pool.Query(ctx, query, n, token, through, after, s.OnFailed != SkipFailed, max(window, 1)-1)
	if err != nil {
		return Window{}, fmt.Errorf("claim outbox batch: %w", err)
	}
	var w Window
	var end pgtype.Int8
	if w.Claimed, err = scanClaimedAnd(rows, &end, &w.Newest); err != nil {
		return Window{}, fmt.Errorf("claim outbox batch: %w", err)
	}
	w.Full, w.End = end.Valid, end.Int64
	return w, nil
}

// Window is what ClaimWindow claimed and saw.
type Window struct {
	Claimed []Claimed
	Newest  int64 // the newest id in the outbox as the claim began
	Full    bool  // the window was full: more unpublished rows may lie beyond End
	End     int64 // the window's last row, if Full
}

// claimWindowSQL is claimSQL through the end of a window of $6+1
// unpublished rows above $4 and up to $3 (or through $3 if there are
// fewer), and it returns, on every row and on one row with nothing
// claimed if it claims nothing, the window's end if it was full and the
// newest id in the outbox.
var claimWindowSQL, claimUnorderedWindowSQL = func() (string, string) {
	window := func(claim string) string {
		const bound, update = "o.id <= $3", "\nUPDATE outbox o"
		if strings.Count(claim, bound) != 1 || strings.Count(claim, update) != 1 || !strings.HasPrefix(claim, "\nWITH picked AS (") {
			panic("outbox: claimSQL is not the one CTE, upper bound and UPDATE that claimWindowSQL rewrites")
		}
		claim = strings.Replace(claim, bound, "o.id <= coalesce((SELECT last FROM bounds), $3)", 1)
		claim = strings.Replace(claim, "\nWITH picked AS (", `
WITH bounds AS (
    SELECT (SELECT id FROM outbox WHERE published_at IS NULL AND id > $4 AND id <= $3 ORDER BY id OFFSET $6 LIMIT 1) AS last,
           (SELECT coalesce(max(id), 0) FROM outbox) AS newest
), picked AS (`, 1)
		claim = strings.Replace(claim, update, "\n, claimed AS ("+update, 1)
		return claim + `
)
SELECT c.id, c.aggregate_type, c.aggregate_id, c.event_type, c.payload, c.headers, c.created_at, c.aggregate_seq,
       b.last, b.newest
FROM bounds b LEFT JOIN claimed c ON true`
	}
	return window(claimSQL), window(claimUnorderedSQL)
}()

// claimHeadsSQL claims up to $1 due heads (an aggregate's first event
// still to publish) under lease token $2 by walking aggregates, not rows:
// from the aggregate after ($4, $5), the first event of each of up to $6
// aggregates with unpublished events (a skip scan of
// outbox_aggregate_unsent_idx: one probe per aggregate, however many
// events wait behind its first). $3 is whether failed rows hold. The last
// row tells how many aggregates were looked at and the last one (with no
// claimed row in it when nothing was claimed).
const claimHeadsSQL = `
WITH RECURSIVE heads AS (
    (SELECT e.aggregate_type, e.aggregate_id, e.id, e.status, 1 AS n FROM outbox e
     WHERE num_nulls(e.published_at) = 1 AND (e.aggregate_type, e.aggregate_id) > ($4, $5)
       AND (e.status IN ('pending', 'sending') OR (e.status = 'failed' AND $3))
     ORDER BY e.aggregate_type, e.aggregate_id, e.aggregate_seq LIMIT 1)
  UNION ALL
    SELECT nx.aggregate_type, nx.aggregate_id, nx.id, nx.status, h.n + 1 FROM heads h, LATERAL (
        SELECT e.aggregate_type, e.aggregate_id, e.id, e.status FROM outbox e
        WHERE num_nulls(e.published_at) = 1 AND (e.aggregate_type, e.aggregate_id) > (h.aggregate_type, h.aggregate_id)
          AND (e.status IN ('pending', 'sending') OR (e.status = 'failed' AND $3))
        ORDER BY e.aggregate_type, e.aggregate_id, e.aggregate_seq LIMIT 1) nx
    WHERE h.n < $6
), picked AS (
    SELECT o.id FROM heads h JOIN outbox o ON o.id = h.id
    WHERE h.status = 'pending' AND o.published_at IS NULL AND o.status = 'pending' AND o.available_at <= now()
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
), claimed AS (
    UPDATE outbox o
    SET status = 'sending', claimed_at = now(), lease_token = $2
    FROM picked
    WHERE o.id = picked.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.created_at, o.aggregate_seq
), seen AS (
    SELECT count(*) AS n,
           (SELECT aggregate_type FROM heads ORDER BY n DESC LIMIT 1) AS last_type,
           (SELECT aggregate_id FROM heads ORDER BY n DESC LIMIT 1) AS last_id
    FROM heads
)
SELECT c.id, c.aggregate_type, c.aggregate_id, c.event_type, c.payload, c.headers, c.created_at, c.aggregate_seq,
       s.n, s.last_type, s.last_id
FROM seen s LEFT JOIN claimed c ON true`

// AggregateKey names an aggregate.
type AggregateKey struct{ Type, ID string }

// Heads is what ClaimHeads claimed and saw.
type Heads struct {
	Claimed []Claimed
	Seen    int          // aggregates looked at
	Last    AggregateKey // the last of them, where the next walk goes on
}

// ClaimHeads claims up to n due heads of the aggregates after `after`, in
// aggregate order, looking at no more than aggregates of them: the relay's
// claim loop goes round the aggregates with it when the rows above its
// floor are mostly events waiting for the one before them, which a walk by
// id would step over one by one. Seen < aggregates means the walk reached
// the last aggregate.
func (s *Store) ClaimHeads(ctx context.Context, n int, token pgtype.UUID, after AggregateKey, aggregates int) (Heads, error) {
	rows, err := s.pool.Query(ctx, claimHeadsSQL, n, token, s.OnFailed != SkipFailed, after.Type, after.ID, max(aggregates, 1))
	if err != nil {
		return Heads{}, fmt.Errorf("claim the heads of aggregates: %w", err)
	}
	var h Heads
	var seen int64
	var lastType, lastID pgtype.Text
	if h.Claimed, err = scanClaimedAnd(rows, &seen, &lastType, &lastID); err != nil {
		return Heads{}, fmt.Errorf("claim the heads of aggregates: %w", err)
	}
	h.Seen, h.Last = int(seen), AggregateKey{Type: lastType.String, ID: lastID.String}
	return h, nil
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

// scanClaimedAnd reads the rows of a claim that also reports what it saw
// (ClaimWindow, ClaimHeads): each row is a claimed row followed by the
// columns read into also, the same on every row, and one row with no
// claimed row in it (all NULL) stands for a claim that took nothing.
func scanClaimedAnd(rows pgx.Rows, also ...any) ([]Claimed, error) {
	defer rows.Close()
	var claimed []Claimed
	for rows.Next() {
		var id, seq pgtype.Int8
		var aggType, aggID, eventType pgtype.Text
		var payload, headers []byte
		var created pgtype.Timestamptz
		if err := rows.Scan(append([]any{&id, &aggType, &aggID, &eventType, &payload, &headers, &created, &seq}, also...)...); err != nil {
			return nil, err
		}
		if id.Valid {
			claimed = append(claimed, Claimed{
				ID: id.Int64, AggregateType: aggType.String, AggregateID: aggID.String, EventType: eventType.String,
				Payload: payload, Headers: headers, CreatedAt: created, AggregateSeq: seq,
			})
		}
	}
	return claimed, rows.Err()
}

func scanClaimed(rows pgx.CollectableRow) (Claimed, error) {
	var c Claimed
	err := rows.Scan(&c.ID, &c.AggregateType, &c.AggregateID, &c.EventType, &c.Payload, &c.Headers, &c.CreatedAt, &c.AggregateSeq)
	return c, err
}

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

// HeldBehindPrefix starts the last error of a row a wal relay marked
// failed because an earlier event of its aggregate failed (relay.on_failed
// hold): "held behind event <id>, ...". A poll relay leaves such rows
// pending; its claim passes them over.
const HeldBehindPrefix = "held behind event "

// HeldBehindReason is the last error of a row held behind the failed
// event failedID.
func HeldBehindReason(failedID int64) string {
	return HeldBehindPrefix + strconv.FormatInt(failedID, 10) + ", an earlier event of its aggregate that failed (relay.on_failed hold): " +
		"fanout outbox retry-failed or fanout outbox skip releases it"
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
