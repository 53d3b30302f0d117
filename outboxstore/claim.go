package outboxstore

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
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
	// LandedSeq is where an earlier publish of the event landed in the
	// stream, when the relay knows of one (0: none): a wal relay decoding
	// again what it had published (relay's replay). The message carries
	// it in RepairedHeader, so that a copy stored again, because the
	// stream lost the earlier one, says so as the auditor's repairs do.
	LandedSeq uint64
}

// RowsClaim is what ClaimRows takes: up to N due heads (an aggregate's
// first event still to publish, or any due row with Store.Unordered)
// among the unpublished rows with ids above After and up to Through (all
// of them: math.MinInt64 and math.MaxInt64), under the lease token Token.
// With Window set,
// the claim walks at most the first Window unpublished rows of that span,
// oldest first, so that its walk is bounded however large the backlog of
// events waiting for the one before them, and it reports what it saw
// (Window.Newest, Full, End, Unsent); without, it walks the span to its
// end.
type RowsClaim struct {
	N              int
	Token          pgtype.UUID
	After, Through int64
	Window         int
}

// ClaimRows moves the rows c picks to `sending` under c.Token, and returns
// them in the order they were picked. It is what the relay's claim loop,
// its sweeper and a wal relay's backlog drain claim with. A windowed
// claim that returns fewer than N rows looked at every row of the window,
// or up to the newest id if the window was not full, whose transaction had
// committed; it is one statement, which finds the window's end once:
// under a held snapshot every walk over the index steps over the entries
// of every row published since.
func (s *Store) ClaimRows(ctx context.Context, c RowsClaim) (Window, error) {
	hold := s.OnFailed != SkipFailed
	if c.Window == 0 {
		query := claimSQL
		if s.Unordered {
			query = claimUnorderedSQL
		}
		rows, err := s.pool.Query(ctx, query, c.N, c.Token, c.Through, c.After, hold)
		if err != nil {
			return Window{}, fmt.Errorf("claim outbox batch: %w", err)
		}
		claimed, err := pgx.CollectRows(rows, scanClaimed)
		if err != nil {
			return Window{}, fmt.Errorf("claim outbox batch: %w", err)
		}
		return Window{Claimed: claimed}, nil
	}
	query := claimWindowSQL
	if s.Unordered {
		query = claimUnorderedWindowSQL
	}
	rows, err := s.pool.Query(ctx, query, c.N, c.Token, c.Through, c.After, hold, c.Window-1)
	if err != nil {
		return Window{}, fmt.Errorf("claim outbox batch: %w", err)
	}
	var w Window
	var end pgtype.Int8
	if w.Claimed, err = scanClaimedAnd(rows, &end, &w.Newest, &w.Unsent); err != nil {
		return Window{}, fmt.Errorf("claim outbox batch: %w", err)
	}
	w.Full, w.End = end.Valid, end.Int64
	return w, nil
}

// Window is what ClaimRows claimed, and, for a windowed claim, saw.
type Window struct {
	Claimed []Claimed
	Newest  int64 // the newest id in the outbox as the claim began
	Full    bool  // the window was full: more unpublished rows may lie beyond End
	End     int64 // the window's last row, if Full
	Unsent  int   // the unpublished rows in the window (at most its size), claimed ones and those in flight among them
}

// claimWindowSQL is claimSQL through the end of a window of $6+1
// unpublished rows above $4 and up to $3 (or through $3 if there are
// fewer), and it returns, on every row and on one row with nothing
// claimed if it claims nothing, the window's end if it was full, the
// newest id in the outbox, and how many unpublished rows the window holds
// (one walk of outbox_unsent_idx finds both: the rows in flight are among
// them, and the rest wait behind an earlier event of their aggregate, or
// for their backoff).
var claimWindowSQL, claimUnorderedWindowSQL = func() (string, string) {
	window := func(claim string) string {
		const bound, update = "o.id <= $3", "\nUPDATE outbox o"
		if strings.Count(claim, bound) != 1 || strings.Count(claim, update) != 1 || !strings.HasPrefix(claim, "\nWITH picked AS (") {
			panic("outbox: claimSQL is not the one CTE, upper bound and UPDATE that claimWindowSQL rewrites")
		}
		claim = strings.Replace(claim, bound, "o.id <= coalesce((SELECT last FROM bounds), $3)", 1)
		claim = strings.Replace(claim, "\nWITH picked AS (", `
WITH win AS MATERIALIZED (
    SELECT id FROM outbox WHERE published_at IS NULL AND id > $4 AND id <= $3 ORDER BY id LIMIT $6 + 1
), bounds AS (
    SELECT w.last, w.unsent, (SELECT coalesce(max(id), 0) FROM outbox) AS newest
    FROM (SELECT CASE WHEN count(*) > $6 THEN max(id) END AS last, count(*) AS unsent FROM win) w
), picked AS (`, 1)
		claim = strings.Replace(claim, update, "\n, claimed AS ("+update, 1)
		return claim + `
)
SELECT c.id, c.aggregate_type, c.aggregate_id, c.event_type, c.payload, c.headers, c.created_at, c.aggregate_seq,
       b.last, b.newest, b.unsent
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

// scanClaimedAnd reads the rows of a claim that also reports what it saw
// (ClaimRows, ClaimHeads): each row is a claimed row followed by the
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
