package outboxstore_test

import (
	"context"
	"encoding/json"
	"math"
	"slices"
	"testing"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// A poll relay with relay.atomic transaction claims whole transactions:
// all of a transaction's rows or none (none while another session holds
// one of them), a transaction only once every earlier event of its
// aggregates is published (or in it), a large one a chunk at a time in id
// order, and a row without a transaction on its own. A window that does
// not start at the lowest id does not take a transaction whose earlier
// rows lie below it.
func TestClaimTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	token := pgtype.UUID{Bytes: [16]byte{7}, Valid: true}

	// t1: order 1's first two events and order 2's first; t2: order 1's
	// third; t3: order 3's first, alone.
	t1 := writeTx(t, db, "1", "1", "2")
	t2 := writeTx(t, db, "1")
	t3 := writeTx(t, db, "3")
	claim := func(after int64, n int) []outboxstore.TxChunk {
		t.Helper()
		w, err := store.TransactionCandidates(ctx, after, nil, 100, 100)
		if err != nil {
			t.Fatal(err)
		}
		chunks, err := store.ClaimTransactions(ctx, w.Candidates, token, 1000, n, after != math.MinInt64)
		if err != nil {
			t.Fatal(err)
		}
		return chunks
	}
	idsOf := func(chunks []outboxstore.TxChunk) [][]int64 {
		var ids [][]int64
		for _, c := range chunks {
			var cids []int64
			for _, r := range c.Rows {
				cids = append(cids, r.ID)
			}
			ids = append(ids, cids)
		}
		return ids
	}

	// Another session holds one of t1's rows: t1 is left whole; t2
	// waits behind it; t3 is claimed.
	lockTx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lockTx.Rollback(ctx) //nolint:errcheck // rolled back below, or at a failure
	if _, err := lockTx.Exec(ctx, `SELECT FROM outbox WHERE id = $1 FOR UPDATE`, t1[1]); err != nil {
		t.Fatal(err)
	}
	got := claim(math.MinInt64, 100)
	if ids := idsOf(got); len(ids) != 1 || !slices.Equal(ids[0], t3) || got[0].More || got[0].Prev != 0 || got[0].XID == "" {
		t.Fatalf("claim while a row of t1 is locked: %v %+v, want t3 %v alone, whole", ids, got, t3)
	}
	if err := lockTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	got = claim(math.MinInt64, 100)
	if ids := idsOf(got); len(ids) != 1 || !slices.Equal(ids[0], t1) {
		t.Fatalf("claim: %v, want t1 %v whole (t2 waits behind it)", ids, t1)
	}
	if ids := idsOf(claim(math.MinInt64, 100)); len(ids) != 0 {
		t.Fatalf("claim while t1 is in flight: %v, want none (t2 waits behind order 1's second event)", ids)
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Sent: append(slices.Clone(t1), t3...)}); err != nil {
		t.Fatal(err)
	}
	if ids := idsOf(claim(math.MinInt64, 100)); len(ids) != 1 || !slices.Equal(ids[0], t2) {
		t.Fatalf("claim after t1: %v, want t2 %v", ids, t2)
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Failed: t2, FailedReasons: []string{"too big"}}); err != nil {
		t.Fatal(err)
	}

	// Order 1's next event is held behind the failed one: claimed, with
	// the failed event named, for the relay to mark it held.
	t4 := writeTx(t, db, "1", "4")
	got = claim(math.MinInt64, 100)
	if ids := idsOf(got); len(ids) != 1 || !slices.Equal(ids[0], t4) || !slices.Equal(got[0].HeldBy, []int64{t2[0], 0}) {
		t.Fatalf("claim behind a failed event: %v %+v, want t4 %v, its first row held behind %d", ids, got, t4, t2[0])
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Sent: t4}); err != nil {
		t.Fatal(err)
	}

	// 2,500 events in one transaction: three chunks, each claimed once
	// the one before is done, each after the first knowing the row just
	// below it.
	big := writeTx(t, db, slices.Repeat([]string{"5", "6"}, 1250)...)
	for i, want := range [][]int64{big[:1000], big[1000:2000], big[2000:]} {
		got = claim(math.MinInt64, 100)
		if ids := idsOf(got); len(ids) != 1 || !slices.Equal(ids[0], want) {
			t.Fatalf("chunk %d: %d chunks, want rows %d..%d", i+1, len(ids), want[0], want[len(want)-1])
		}
		wantPrev := int64(0)
		if i > 0 {
			wantPrev = big[1000*i-1]
		}
		if got[0].More != (i < 2) || got[0].Prev != wantPrev {
			t.Fatalf("chunk %d: more %v, prev %d; want more %v, prev %d", i+1, got[0].More, got[0].Prev, i < 2, wantPrev)
		}
		if n, err := store.TransactionRowsBelow(ctx, got[0].XID, want[0]); err != nil || n != int64(1000*i) {
			t.Fatalf("chunk %d: %d rows below it (%v), want %d", i+1, n, err, 1000*i)
		}
		if ids := idsOf(claim(math.MinInt64, 100)); len(ids) != 0 {
			t.Fatalf("chunk %d in flight, claimed %v besides", i+1, ids)
		}
		if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Sent: want}); err != nil {
			t.Fatal(err)
		}
	}

	// Rows written before the outbox kept transactions go one by one.
	old := writeTx(t, db, "7", "8")
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET writer_xid = NULL WHERE id = ANY($1)`, old); err != nil {
		t.Fatal(err)
	}
	got = claim(math.MinInt64, 1)
	if ids := idsOf(got); len(ids) != 1 || !slices.Equal(ids[0], old[:1]) || got[0].XID != "" {
		t.Fatalf("claim rows without a transaction, at most 1: %v %+v, want %d alone", ids, got, old[0])
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Sent: old[:1]}); err != nil {
		t.Fatal(err)
	}
	if ids := idsOf(claim(math.MinInt64, 100)); len(ids) != 1 || !slices.Equal(ids[0], old[1:]) {
		t.Fatalf("claim: %v, want %d", ids, old[1])
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Sent: old[1:]}); err != nil {
		t.Fatal(err)
	}

	// A window from above a transaction's first row does not take the
	// rest of it; from the lowest id it takes all of it.
	split := writeTx(t, db, "9", "10", "11")
	if ids := idsOf(claim(split[0], 100)); len(ids) != 0 {
		t.Fatalf("claim from above the transaction's first row: %v, want none", ids)
	}
	if ids := idsOf(claim(math.MinInt64, 100)); len(ids) != 1 || !slices.Equal(ids[0], split) {
		t.Fatalf("claim: %v, want %v", ids, split)
	}
}

// writeTx commits one event per order named, in one transaction, and
// returns their ids.
func writeTx(t *testing.T, db *pgtest.DB, orders ...string) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for _, order := range orders {
			id, err := outbox.Write(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: order, Type: "order.created",
				Payload: json.RawMessage(`{"order_id": ` + order + `}`)})
			if err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// A relay claims a big transaction's next chunks while it publishes the
// ones before (ClaimTransactionNext): only while every row below the
// chunk still to publish is sending under one of the leases it names,
// never while one is under another lease or back to pending.
func TestClaimTransactionNext(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	first := pgtype.UUID{Bytes: [16]byte{1}, Valid: true}
	stream := pgtype.UUID{Bytes: [16]byte{2}, Valid: true}
	other := pgtype.UUID{Bytes: [16]byte{3}, Valid: true}
	big := writeTx(t, db, slices.Repeat([]string{"1", "2", "3", "4", "5"}, 700)...)
	w, err := store.TransactionCandidates(ctx, math.MinInt64, nil, 5000, 10)
	if err != nil {
		t.Fatal(err)
	}
	got, err := store.ClaimTransactions(ctx, w.Candidates, first, 1000, 1000, false)
	if err != nil || len(got) != 1 || len(got[0].Rows) != 1000 || !got[0].More {
		t.Fatalf("first chunk: %+v (%v), want 1000 rows and more", got, err)
	}
	xid := got[0].XID
	next := func(after int64, below ...pgtype.UUID) (outboxstore.TxChunk, bool) {
		t.Helper()
		c, ok, err := store.ClaimTransactionNext(ctx, xid, after, below, stream, 1000)
		if err != nil {
			t.Fatal(err)
		}
		return c, ok
	}
	if c, ok := next(big[999], other); ok {
		t.Fatalf("claimed rows %d.. while the chunk below is sending under another lease", c.Rows[0].ID)
	}
	for i, want := range [][]int64{big[1000:2000], big[2000:3000]} {
		c, ok := next(want[0]-1, first, stream)
		if !ok || len(c.Rows) != len(want) || c.Rows[0].ID != want[0] || c.Rows[len(c.Rows)-1].ID != want[len(want)-1] || c.Prev != want[0]-1 || !c.More {
			t.Fatalf("chunk %d: %v %+v, want rows %d..%d after %d, more", i+2, ok, c.Prev, want[0], want[len(want)-1], want[0]-1)
		}
	}
	// The first chunk published, the second sent back to wait: the
	// chunk after them is not claimed.
	if _, _, err := store.Record(ctx, first, outboxstore.Outcomes{Sent: big[:1000]}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Record(ctx, stream, outboxstore.Outcomes{Returned: big[1000:2000]}); err != nil {
		t.Fatal(err)
	}
	if c, ok := next(big[2999], first, stream); ok {
		t.Fatalf("claimed rows %d.. while rows below are pending again", c.Rows[0].ID)
	}
	if _, _, err := store.ClaimTransactionNext(ctx, xid, big[2999], nil, stream, 1000); err == nil {
		t.Fatal("claimed the next chunk with no lease named for the rows below")
	}
}

// A delivery goes on with the transactions holding the next events of the
// aggregates it published (NextTransactions): each named once, by its
// first row still to publish, oldest first; a next event already claimed
// (sending) names none, nor does an aggregate with no next event.
func TestNextTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	token := pgtype.UUID{Bytes: [16]byte{9}, Valid: true}

	// t1 publishes orders 1, 2, 3 and 4; t2 holds order 1's next event
	// (and order 5's first, below it); t3 order 2's next and order 1's
	// third; t4 order 3's next, claimed already.
	t1 := writeTx(t, db, "1", "2", "3", "4")
	t2 := writeTx(t, db, "5", "1")
	t3 := writeTx(t, db, "2", "1")
	t4 := writeTx(t, db, "3")
	claimed, err := store.ClaimTransactions(ctx, []outboxstore.TxCandidate{{XID: xidOf(t, db, t1[0]), First: t1[0]}}, token, 1000, 1000, false)
	if err != nil || len(claimed) != 1 || len(claimed[0].Rows) != 4 {
		t.Fatalf("claim t1: %+v (%v)", claimed, err)
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Sent: t1}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET status = 'sending', lease_token = gen_random_uuid(), claimed_at = now() WHERE id = $1`, t4[0]); err != nil {
		t.Fatal(err)
	}
	cands, err := store.NextTransactions(ctx, claimed[0].Rows)
	if err != nil {
		t.Fatal(err)
	}
	want := []outboxstore.TxCandidate{{XID: xidOf(t, db, t2[0]), First: t2[0]}, {XID: xidOf(t, db, t3[0]), First: t3[0]}}
	if !slices.Equal(cands, want) {
		t.Fatalf("next transactions: %+v, want t2 and t3 by their first rows: %+v", cands, want)
	}
	if cands, err := store.NextTransactions(ctx, nil); err != nil || len(cands) != 0 {
		t.Fatalf("next transactions of nothing published: %+v (%v)", cands, err)
	}
}

// xidOf returns the writer transaction of the outbox row id.
func xidOf(t *testing.T, db *pgtest.DB, id int64) string {
	t.Helper()
	var xid string
	if err := db.Pool.QueryRow(context.Background(), `SELECT writer_xid::text FROM outbox WHERE id = $1`, id).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	return xid
}
