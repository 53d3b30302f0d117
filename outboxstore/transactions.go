package outboxstore

import (
	"context"
	"fmt"
	"math"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// Claims by writer transaction, for a poll relay with relay.atomic
// transaction: a transaction's rows are claimed together or not at all,
// so that the relay can publish them as one atomic batch. Each row holds
// the transaction that inserted it (writer_xid, migration 00022); a row
// without one (written before it) is a transaction of its own.
//
// A transaction of more than chunk rows (the batch limit) is claimed a
// chunk at a time, in id order, each chunk once the one before is done.
//
// A transaction is ready when every one of its rows still to publish
// (pending or sending) is pending and due, and each numbered row's
// previous event is published, or in the same transaction, or failed
// (then, under relay.on_failed hold, the relay marks the row failed as
// held behind it, as a wal relay does). The numbers are given in commit
// order, so the transactions' dependencies follow their commits and the
// first transaction committed among the unpublished is always ready.
//
// The lookups of a transaction's rows plan on the ranges' statistics: a
// range analyzed while nearly empty has its unsent index counted as one
// entry, and each candidate then walks all of it. A relay whose claim is
// slow asks for fresh statistics (relay's slowTxClaim). Bounding the
// lookups by (writer_xid, id) row comparisons, which no other index can
// serve, did not keep them off that index and made a big transaction's
// chunk claims slower (24,236 rows/s against 17,261, one run each).

// TxCandidate is a writer transaction whose first row still to publish
// lies in a claim's window: its id, with the transaction's (empty for a
// row without one).
type TxCandidate struct {
	XID   string
	First int64
	Rows  int // its rows in the window
}

// txCandidatesSQL walks the first $2 unpublished rows above $1 and up to
// $4 (failed ones too: they are in outbox_unsent_idx) and returns the
// transactions whose rows there are all pending and due, by their first
// row, up to $3 of them, and on every row whether the window was full
// (more unpublished rows lie beyond it) and its last id. With $5 (a
// snapshot's text, empty for none), only transactions visible in it are
// returned (a slot's backlog: SlotBacklog). A window from the lowest id
// holds every row still to publish of each transaction it returns that
// lies below the last of them; a window from further up may not, which
// the claim then checks (claimTransactionsSQL's $7).
const txCandidatesSQL = `
WITH win AS MATERIALIZED (
    SELECT id, writer_xid, status, available_at <= now() AS due
    FROM outbox WHERE published_at IS NULL AND id > $1 AND id <= $4
    ORDER BY id LIMIT $2
), bounds AS (
    SELECT count(*) >= $2 AS full, max(id) AS last FROM win
), txs AS (
    SELECT writer_xid::text AS xid, min(id) AS first, count(*) AS n
    FROM win WHERE status IN ('pending', 'sending')
      AND ($5 = '' OR writer_xid IS NULL OR pg_visible_in_snapshot(writer_xid, nullif($5, '')::pg_snapshot))
    GROUP BY writer_xid, CASE WHEN writer_xid IS NULL THEN id END
    HAVING bool_and(status = 'pending' AND due)
    ORDER BY first
    LIMIT $3
)
SELECT t.xid, t.first, t.n, b.full, b.last FROM bounds b LEFT JOIN txs t ON true ORDER BY t.first`

// TxWindow is what TransactionCandidates saw.
type TxWindow struct {
	Candidates []TxCandidate
	Full       bool  // more unpublished rows lie beyond the window
	Last       int64 // the window's last id, if Full
}

// TransactionCandidates returns the transactions ready to claim, as far
// as the first window unpublished rows above after show, up to most of
// them, oldest first; with in, only those of a slot's backlog (ids up to
// its bound, visible in its snapshot).
func (s *Store) TransactionCandidates(ctx context.Context, after int64, in *SlotBacklog, window, most int) (TxWindow, error) {
	through, snapshot := int64(math.MaxInt64), ""
	if in != nil {
		through, snapshot = in.Through, in.Snapshot
	}
	rows, err := s.pool.Query(ctx, txCandidatesSQL, after, max(window, 1), max(most, 1), through, snapshot)
	if err != nil {
		return TxWindow{}, fmt.Errorf("find the outbox's transactions to claim: %w", err)
	}
	var w TxWindow
	var xid pgtype.Text
	var first, n, last pgtype.Int8
	_, err = pgx.ForEachRow(rows, []any{&xid, &first, &n, &w.Full, &last}, func() error {
		if first.Valid {
			w.Candidates = append(w.Candidates, TxCandidate{XID: xid.String, First: first.Int64, Rows: int(n.Int64)})
		}
		return nil
	})
	if err != nil {
		return TxWindow{}, fmt.Errorf("find the outbox's transactions to claim: %w", err)
	}
	w.Last = last.Int64
	return w, nil
}

// nextTransactionsSQL finds the transactions holding the next event (by
// number) of each aggregate ($1 types, $2 ids, $3 numbers) whose event
// was just published, still pending, with the first row of each still to
// publish: a chain of transactions over the same aggregates (a backlog
// of busy aggregates) goes on at the pace of its publishes, not of the
// claim loop's walks.
const nextTransactionsSQL = `
WITH nxt AS (
    SELECT DISTINCT n.writer_xid, CASE WHEN n.writer_xid IS NULL THEN n.id END AS solo
    FROM unnest($1::text[], $2::text[], $3::bigint[]) AS p(typ, agg, seq)
    JOIN outbox n ON n.aggregate_type = p.typ AND n.aggregate_id = p.agg AND n.aggregate_seq = p.seq + 1
    WHERE num_nulls(n.published_at) = 1 AND n.status = 'pending'
)
SELECT x.writer_xid::text,
       coalesce(x.solo, (SELECT min(e.id) FROM outbox e
                         WHERE e.writer_xid = x.writer_xid AND e.published_at IS NULL AND e.status IN ('pending', 'sending'))) AS first
FROM nxt x ORDER BY first`

// NextTransactions returns the transactions that hold the next events of
// the aggregates of published (rows just recorded sent), oldest first,
// as candidates for ClaimTransactions (whose checks they go through like
// any other: a window did not find them, so with checkBelow).
func (s *Store) NextTransactions(ctx context.Context, published []Claimed) ([]TxCandidate, error) {
	var types, ids []string
	var seqs []int64
	for _, c := range published {
		if c.AggregateSeq.Valid {
			types, ids, seqs = append(types, c.AggregateType), append(ids, c.AggregateID), append(seqs, c.AggregateSeq.Int64)
		}
	}
	if len(seqs) == 0 {
		return nil, nil
	}
	rows, err := s.pool.Query(ctx, nextTransactionsSQL, types, ids, seqs)
	if err != nil {
		return nil, fmt.Errorf("find the transactions of the published aggregates' next events: %w", err)
	}
	var cands []TxCandidate
	var xid pgtype.Text
	var first pgtype.Int8
	_, err = pgx.ForEachRow(rows, []any{&xid, &first}, func() error {
		if first.Valid {
			cands = append(cands, TxCandidate{XID: xid.String, First: first.Int64})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("find the transactions of the published aggregates' next events: %w", err)
	}
	return cands, nil
}

// claimTransactionsSQL claims, under lease token $3, the next chunk of
// each candidate transaction ($1 its writer_xid or NULL, $2 its first row
// still to publish) that is ready (see above), up to $6 rows in all (at
// least the first ready chunk's), chunks of at most $5 rows. $4 is
// whether failed rows hold the events behind them. With $7, a candidate
// whose rows below its first are not all done is not ready (a window
// that did not start from the lowest id may have missed them), but for
// those sending under one of the lease tokens $8 (the chunks before,
// which this relay is publishing: ClaimTransactionNext).
//
// A chunk is claimed only if every row of it is locked by this claim:
// another relay claiming at once locks some (SKIP LOCKED), and both leave
// the transaction to the next claim rather than each publishing a part.
//
// Each claimed row comes with its candidate's number, the failed event it
// is held behind (or NULL), whether the transaction has rows beyond the
// chunk, and the transaction's row just below the chunk, if any (the
// relay numbers the chunks by it).
const claimTransactionsSQL = `
WITH cand AS (
    SELECT c.xid::xid8 AS xid, c.first, c.ord
    FROM unnest($1::text[], $2::bigint[]) WITH ORDINALITY AS c(xid, first, ord)
    WHERE NOT $7 OR c.xid IS NULL OR NOT EXISTS (
        SELECT FROM outbox e
        WHERE e.writer_xid = c.xid::xid8 AND e.id < c.first AND e.published_at IS NULL AND e.status IN ('pending', 'sending')
          AND NOT (e.status = 'sending' AND coalesce(e.lease_token = ANY ($8::uuid[]), false)))
), txrows AS MATERIALIZED (
    SELECT c.ord, c.xid, c.first, r.id, r.status, r.due, r.aggregate_type, r.aggregate_id, r.aggregate_seq
    FROM cand c CROSS JOIN LATERAL (
        SELECT e.id, e.status, e.available_at <= now() AS due, e.aggregate_type, e.aggregate_id, e.aggregate_seq
        FROM outbox e
        WHERE e.writer_xid = c.xid AND e.id >= c.first AND e.published_at IS NULL AND e.status IN ('pending', 'sending')
        ORDER BY e.writer_xid, e.id
        LIMIT $5 + 1
    ) r
    UNION ALL
    SELECT c.ord, c.xid, c.first, e.id, e.status, e.available_at <= now(), e.aggregate_type, e.aggregate_id, e.aggregate_seq
    FROM cand c JOIN outbox e ON e.id = c.first
    WHERE c.xid IS NULL AND e.published_at IS NULL AND e.status IN ('pending', 'sending')
), ranked AS (
    SELECT t.*, row_number() OVER (PARTITION BY t.ord ORDER BY t.id) AS rn, count(*) OVER (PARTITION BY t.ord) AS n
    FROM txrows t
), chunk AS MATERIALIZED (
    SELECT k.*, coalesce(p.blocked, false) AS blocked, p.held_by
    FROM ranked k CROSS JOIN LATERAL (
        -- The previous event of the row's aggregate, one probe for both.
        SELECT bool_or(e.status IN ('pending', 'sending') AND (k.xid IS NULL OR e.writer_xid IS DISTINCT FROM k.xid)) AS blocked,
               max(e.id) FILTER (WHERE $4 AND e.status = 'failed') AS held_by
        FROM outbox e
        WHERE k.aggregate_seq IS NOT NULL AND e.aggregate_type = k.aggregate_type AND e.aggregate_id = k.aggregate_id
          AND e.aggregate_seq = k.aggregate_seq - 1 AND num_nulls(e.published_at) = 1
    ) p
    WHERE k.rn <= $5
), ready AS (
    SELECT ord, count(*) AS n FROM chunk GROUP BY ord
    HAVING bool_and(status = 'pending' AND due AND NOT blocked)
), capped AS (
    SELECT ord FROM (SELECT ord, sum(n) OVER (ORDER BY ord) AS upto FROM ready) x
    WHERE upto <= $6 OR ord = (SELECT min(ord) FROM ready)
), pick AS MATERIALIZED (
    SELECT c.id, c.ord FROM chunk c WHERE c.ord IN (SELECT ord FROM capped)
), locked AS (
    SELECT o.id FROM outbox o
    WHERE o.id = ANY (ARRAY(SELECT id FROM pick)) AND o.published_at IS NULL AND o.status = 'pending'
    FOR UPDATE OF o SKIP LOCKED
), whole AS (
    SELECT p.id FROM (
        SELECT p.id, p.ord, count(*) OVER (PARTITION BY p.ord) AS got FROM locked l JOIN pick p ON p.id = l.id
    ) p JOIN ready r ON r.ord = p.ord
    WHERE p.got = r.n
), prev AS (
    SELECT c.ord, (SELECT max(e.id) FROM outbox e WHERE e.writer_xid = c.xid AND e.id < c.first) AS id
    FROM cand c WHERE c.xid IS NOT NULL AND c.ord IN (SELECT ord FROM capped)
), claimed AS (
    UPDATE outbox o
    SET status = 'sending', claimed_at = now(), lease_token = $3
    FROM whole l
    WHERE o.id = l.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.created_at, o.aggregate_seq
)
SELECT c.id, c.aggregate_type, c.aggregate_id, c.event_type, c.payload, c.headers, c.created_at, c.aggregate_seq,
       k.ord, k.held_by, k.xid::text, k.n > $5, p.id
FROM claimed c JOIN chunk k ON k.id = c.id LEFT JOIN prev p ON p.ord = k.ord
ORDER BY k.ord, c.id`

// TxChunk is a chunk of a writer transaction a relay claimed.
type TxChunk struct {
	XID  string    // the writer's transaction (pg_current_xact_id), or "" for a row without one
	Rows []Claimed // in id order
	// HeldBy: for each row, the failed event of its aggregate it is held
	// behind (relay.on_failed hold), or 0.
	HeldBy []int64
	More   bool  // the transaction has rows still to publish beyond the chunk
	Prev   int64 // the transaction's row just below the chunk, or 0 for its first chunk
}

// ClaimTransactions claims the next chunk (at most chunk rows) of each
// ready transaction of cands, up to n rows in all but at least one chunk,
// under the lease token. checkBelow: cands come from a window that did
// not start at the lowest unpublished id.
func (s *Store) ClaimTransactions(ctx context.Context, cands []TxCandidate, token pgtype.UUID, chunk, n int, checkBelow bool) ([]TxChunk, error) {
	return s.claimTransactions(ctx, cands, token, chunk, n, checkBelow, []pgtype.UUID{})
}

// ClaimTransactionNext claims, under the lease token, the chunk (at most
// chunk rows) of the writer transaction xid that follows its row after,
// while the chunks before it are still sending under the leases below: a
// relay claims a big transaction's next chunks while it publishes the
// ones before, and publishes each only once those are in the stream. It
// claims nothing (false) if the chunk is not ready, or if any row of the
// transaction below it is still to publish other than under below.
func (s *Store) ClaimTransactionNext(ctx context.Context, xid string, after int64, below []pgtype.UUID, token pgtype.UUID, chunk int) (TxChunk, bool, error) {
	if xid == "" || len(below) == 0 {
		return TxChunk{}, false, fmt.Errorf("claim the next chunk of a transaction: no transaction or lease (%q)", xid)
	}
	chunks, err := s.claimTransactions(ctx, []TxCandidate{{XID: xid, First: after + 1}}, token, chunk, chunk, true, below)
	if err != nil || len(chunks) == 0 {
		return TxChunk{}, false, err
	}
	return chunks[0], true, nil
}

func (s *Store) claimTransactions(ctx context.Context, cands []TxCandidate, token pgtype.UUID, chunk, n int, checkBelow bool, below []pgtype.UUID) ([]TxChunk, error) {
	if len(cands) == 0 {
		return nil, nil
	}
	xids := make([]pgtype.Text, len(cands))
	firsts := make([]int64, len(cands))
	for i, c := range cands {
		xids[i] = pgtype.Text{String: c.XID, Valid: c.XID != ""}
		firsts[i] = c.First
	}
	rows, err := s.pool.Query(ctx, claimTransactionsSQL, xids, firsts, token, s.OnFailed != SkipFailed, max(chunk, 1), max(n, 1), checkBelow, below)
	if err != nil {
		return nil, fmt.Errorf("claim the outbox's transactions: %w", err)
	}
	var chunks []TxChunk
	lastOrd := int64(math.MinInt64)
	var c Claimed
	var ord int64
	var heldBy, prev pgtype.Int8
	var xid pgtype.Text
	var more bool
	_, err = pgx.ForEachRow(rows, []any{&c.ID, &c.AggregateType, &c.AggregateID, &c.EventType, &c.Payload, &c.Headers, &c.CreatedAt, &c.AggregateSeq,
		&ord, &heldBy, &xid, &more, &prev}, func() error {
		if ord != lastOrd {
			chunks = append(chunks, TxChunk{XID: xid.String, More: more, Prev: prev.Int64})
			lastOrd = ord
		}
		t := &chunks[len(chunks)-1]
		row := c
		row.Payload, row.Headers = append([]byte(nil), c.Payload...), append([]byte(nil), c.Headers...)
		t.Rows = append(t.Rows, row)
		t.HeldBy = append(t.HeldBy, heldBy.Int64)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim the outbox's transactions: %w", err)
	}
	return chunks, nil
}

// TransactionRowsBelow counts the rows of the writer transaction xid with
// ids below id, whatever their state: where a chunk starting at id lies
// in its transaction, for a relay that did not publish the chunks before.
func (s *Store) TransactionRowsBelow(ctx context.Context, xid string, id int64) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE writer_xid = $1::xid8 AND id < $2`, xid, id).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count the rows of transaction %s below %d: %w", xid, id, err)
	}
	return n, nil
}
