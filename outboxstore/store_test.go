package outboxstore_test

import (
	"context"
	"encoding/json"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The store's operations on a database of its own (the package's relay
// works the shared one): each row moves as its method says, and only the
// rows its lease token holds.
func TestStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	// Six orders, one event each: the claims below take any of them (an
	// order's own events go one at a time: TestClaimKeepsEachAggregatesOrder).
	var ids []int64
	for order := range 6 {
		ids = append(ids, writeOrders(t, db.Pool, 1, strconv.Itoa(order+1))...)
	}
	backlog := func() outboxstore.Backlog {
		t.Helper()
		b, err := store.Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if b := backlog(); b.Pending != 6 || b.Sending != 0 || b.Failed != 0 || b.OldestPending <= 0 {
		t.Fatalf("backlog of 6 new rows: %+v", b)
	}

	token := pgtype.UUID{Bytes: [16]byte{1}, Valid: true}
	claimed, err := claimAll(ctx, t, store, 4, token)
	if err != nil || len(claimed) != 4 || claimed[0].ID != ids[0] || string(claimed[0].Headers) == "" {
		t.Fatalf("claim 4: %d rows %+v (%v)", len(claimed), claimed, err)
	}
	if b := backlog(); b.Pending != 2 || b.Sending != 4 {
		t.Fatalf("after the claim: %+v", b)
	}
	// Another relay's token changes nothing.
	if sent, _, err := store.Record(ctx, pgtype.UUID{Bytes: [16]byte{2}, Valid: true}, outboxstore.Outcomes{Sent: ids[:4]}); err != nil || sent != 0 {
		t.Fatalf("record under a stale token: %d marked (%v)", sent, err)
	}
	sent, _, err := store.Record(ctx, token, outboxstore.Outcomes{
		Sent:  ids[:2],
		Retry: ids[2:3], RetryReasons: []string{"nats down"}, RetryMin: time.Hour, RetryMax: 2 * time.Hour,
		Failed: ids[3:4], FailedReasons: []string{"too big"},
	})
	if err != nil || sent != 2 {
		t.Fatalf("record: %d sent (%v)", sent, err)
	}
	if b := backlog(); b.Pending != 3 || b.Sending != 0 || b.Failed != 1 {
		t.Fatalf("after the record: %+v", b)
	}
	if n, err := store.CountSent(ctx); err != nil || n != 2 {
		t.Fatalf("sent rows: %d (%v)", n, err)
	}
	if n, err := store.Unsent(ctx, nil); err != nil || n != 4 {
		t.Fatalf("unsent rows: %d (%v), want 4 (one retried, one failed, two never claimed)", n, err)
	}
	if n, err := store.Unsent(ctx, ids[1:4]); err != nil || n != 2 {
		t.Fatalf("unsent among %v: %d (%v), want 2", ids[1:4], n, err)
	}
	// The retried row backs off: only the two never claimed are due.
	if again, err := claimAll(ctx, t, store, 10, token); err != nil || len(again) != 2 || again[0].ID != ids[4] {
		t.Fatalf("claim after a retry: %+v (%v), want the two rows never claimed", again, err)
	}
	// Their relay dies: the reaper returns them once their lease is over.
	if n, err := store.Reap(ctx, time.Hour); err != nil || n != 0 {
		t.Fatalf("reap of a live lease: %d (%v)", n, err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET claimed_at = now() - interval '2 hours' WHERE status = 'sending'`); err != nil {
		t.Fatal(err)
	}
	if n, err := store.Reap(ctx, time.Hour); err != nil || n != 2 {
		t.Fatalf("reap of expired leases: %d (%v)", n, err)
	}

	if n, err := store.RetryFailed(ctx); err != nil || n != 1 {
		t.Fatalf("retry failed: %d (%v)", n, err)
	}
	var lastError string
	if err := db.Pool.QueryRow(ctx, `SELECT last_error FROM outbox WHERE id = $1 AND status = 'pending' AND attempts = 0`, ids[3]).Scan(&lastError); err != nil ||
		lastError != "retried by an operator after: too big" {
		t.Fatalf("the retried failed row: %q (%v)", lastError, err)
	}

	n, oldest, err := store.Republish(ctx, time.Now().Add(-time.Minute))
	if err != nil || n != 2 || oldest == nil {
		t.Fatalf("republish the last minute: %d rows, oldest retained %v (%v)", n, oldest, err)
	}
	if n, err := store.CountSent(ctx); err != nil || n != 0 {
		t.Fatalf("sent rows after the republish: %d (%v)", n, err)
	}
	// A wal relay leaves the rows it published pending: while its slot is
	// recorded, the pending rows created since are returned too (an update
	// the wal relay decodes), and none created before.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO relay_capture (slot_name, backlog_through) VALUES ('fanout_relay', 0)`); err != nil {
		t.Fatal(err)
	}
	if n, _, err := store.Republish(ctx, time.Now().Add(time.Minute)); err != nil || n != 0 {
		t.Fatalf("republish captured rows from the future: %d rows (%v)", n, err)
	}
	if n, oldest, err := store.Republish(ctx, time.Now().Add(-time.Minute)); err != nil || n != 6 || oldest == nil {
		t.Fatalf("republish captured rows of the last minute: %d rows, oldest retained %v (%v); want all 6", n, oldest, err)
	}

	// Sent rows past their retention go, in batches.
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET status = 'sent', published_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	if n, err := store.DeleteSent(ctx, 3*time.Hour, 10); err != nil || n != 0 {
		t.Fatalf("delete sent within retention: %d (%v)", n, err)
	}
	if n, err := store.DeleteSent(ctx, time.Hour, 4); err != nil || n != 4 {
		t.Fatalf("delete a batch of 4 past retention: %d (%v)", n, err)
	}
	if n, err := store.CountSent(ctx); err != nil || n != 2 {
		t.Fatalf("sent rows left: %d (%v)", n, err)
	}

	// Rows a wal relay captured stay pending; those past retention go, from
	// the time an operator last returned them if that is later, and none at
	// or below the slot's backlog bound.
	if _, err := db.Pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
		t.Fatal(err)
	}
	captured := writeOrders(t, db.Pool, 4, "2")
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET created_at = now() - interval '2 hours', available_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET available_at = now() WHERE id = $1`, captured[3]); err != nil {
		t.Fatal(err)
	}
	if n, err := store.DeleteCaptured(ctx, time.Hour, 10, captured[0]); err != nil || n != 2 {
		t.Fatalf("delete captured rows past retention: %d (%v), want 2 (not the one at the bound, not the one returned just now)", n, err)
	}
	var left []int64
	rows, err := db.Pool.Query(ctx, `SELECT id FROM outbox ORDER BY id`)
	if err == nil {
		left, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	}
	if err != nil || len(left) != 2 || left[0] != captured[0] || left[1] != captured[3] {
		t.Fatalf("rows left: %v (%v), want %d and %d", left, err, captured[0], captured[3])
	}
}

// The claim takes an aggregate's next event only once the one before is
// published; ClaimNext takes it at once; a failed event holds the ones
// behind it, unless the store skips failed events.
func TestClaimKeepsEachAggregatesOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	x := writeOrders(t, db.Pool, 3, "7")
	y := writeOrders(t, db.Pool, 1, "8")
	token := pgtype.UUID{Bytes: [16]byte{1}, Valid: true}
	claim := func() []int64 {
		t.Helper()
		claimed, err := claimAll(ctx, t, store, 10, token)
		if err != nil {
			t.Fatal(err)
		}
		ids := make([]int64, len(claimed))
		for i, c := range claimed {
			ids[i] = c.ID
		}
		return ids
	}
	first, err := claimAll(ctx, t, store, 10, token)
	if err != nil || len(first) != 2 || first[0].ID != x[0] || first[1].ID != y[0] || first[0].AggregateSeq.Int64 != 1 {
		t.Fatalf("first claim: %+v (%v), want the first event of each order", first, err)
	}
	if got := claim(); len(got) != 0 {
		t.Fatalf("claim while the first events are in flight: %v, want none", got)
	}
	// The next events are claimed with the record, in its transaction.
	_, next, err := store.Record(ctx, token, outboxstore.Outcomes{
		Sent: []int64{x[0], y[0]},
		Next: &outboxstore.NextClaim{Published: first, Token: token, Depth: 1, N: 10},
	})
	if err != nil || len(next) != 1 || next[0].ID != x[1] || next[0].AggregateSeq.Int64 != 2 {
		t.Fatalf("claim the next events: %+v (%v), want order 7's second", next, err)
	}
	if again, err := store.ClaimNext(ctx, first, token, 1, 10); err != nil || len(again) != 0 {
		t.Fatalf("claim the next events again: %+v (%v), want none (claimed already)", again, err)
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Failed: []int64{x[1]}, FailedReasons: []string{"too big"}}); err != nil {
		t.Fatal(err)
	}
	if got := claim(); len(got) != 0 {
		t.Fatalf("claim behind a failed event: %v, want none (held)", got)
	}
	if rows, aggs, err := store.Held(ctx); err != nil || rows != 1 || aggs != 1 {
		t.Fatalf("held: %d rows of %d aggregates (%v), want 1 of 1", rows, aggs, err)
	}
	store.OnFailed = outboxstore.SkipFailed
	if got := claim(); len(got) != 1 || got[0] != x[2] {
		t.Fatalf("claim past a failed event with on_failed skip: %v, want %d", got, x[2])
	}
}

// A windowed ClaimRows walks a bounded window of unpublished rows by id and says
// whether more lie beyond it; ClaimHeads finds each aggregate's first
// unpublished event anywhere, one probe per aggregate, and goes round the
// aggregates from where it stopped.
func TestClaimWindowAndClaimHeads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	a := writeOrders(t, db.Pool, 5, "1")
	b := writeOrders(t, db.Pool, 5, "2")
	c := writeOrders(t, db.Pool, 1, "3")
	token := pgtype.UUID{Bytes: [16]byte{3}, Valid: true}

	// Up to order 1's second event, a window of 3 rows is not full.
	w, err := store.ClaimRows(ctx, outboxstore.RowsClaim{N: 10, Token: token, After: 0, Through: a[1], Window: 3})
	if err != nil || len(w.Claimed) != 1 || w.Claimed[0].ID != a[0] || w.Full || w.Newest != c[0] {
		t.Fatalf("claim a window of 3 through %d: %+v (%v), want order 1's first event, not full, newest %d", a[1], w, err, c[0])
	}
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Returned: []int64{a[0]}}); err != nil {
		t.Fatal(err)
	}
	// A window of 3 rows holds order 1's first three events: one head.
	w, err = store.ClaimRows(ctx, outboxstore.RowsClaim{N: 10, Token: token, After: 0, Through: math.MaxInt64, Window: 3})
	if err != nil || len(w.Claimed) != 1 || w.Claimed[0].ID != a[0] || !w.Full || w.End != a[2] || w.Newest != c[0] {
		t.Fatalf("claim a window of 3: %+v (%v), want order 1's first event, full, ending at %d, newest %d", w, err, a[2], c[0])
	}
	// Order 1 is in flight; the heads of orders 2 and 3 are found beyond
	// any window, and order 1's next events are not taken.
	h, err := store.ClaimHeads(ctx, 10, token, outboxstore.AggregateKey{}, 10)
	if err != nil || len(h.Claimed) != 2 || h.Claimed[0].ID != b[0] || h.Claimed[1].ID != c[0] || h.Seen != 3 || h.Last != (outboxstore.AggregateKey{Type: "order", ID: "3"}) {
		t.Fatalf("claim heads: %+v (%v), want the first events of orders 2 and 3, 3 aggregates seen, the last order 3", h, err)
	}
	// Going round two aggregates at a time: orders 1 and 2 (in flight,
	// nothing to claim), then order 3 (in flight too), then the end.
	h, err = store.ClaimHeads(ctx, 10, token, outboxstore.AggregateKey{}, 2)
	if err != nil || len(h.Claimed) != 0 || h.Seen != 2 || h.Last != (outboxstore.AggregateKey{Type: "order", ID: "2"}) {
		t.Fatalf("claim heads, 2 aggregates: %+v (%v), want none claimed, 2 seen, the last order 2", h, err)
	}
	if h, err = store.ClaimHeads(ctx, 10, token, h.Last, 2); err != nil || h.Seen != 1 {
		t.Fatalf("claim heads after order 2: %+v (%v), want 1 seen", h, err)
	}
	if h, err = store.ClaimHeads(ctx, 10, token, h.Last, 2); err != nil || h.Seen != 0 || len(h.Claimed) != 0 {
		t.Fatalf("claim heads after the last order: %+v (%v), want none seen", h, err)
	}
	// Order 2's first event published: its second is its head now; a
	// failed event holds its order unless failed events are skipped.
	if _, _, err := store.Record(ctx, token, outboxstore.Outcomes{Sent: []int64{b[0]}, Failed: []int64{a[0]}, FailedReasons: []string{"too big"}}); err != nil {
		t.Fatal(err)
	}
	if h, err = store.ClaimHeads(ctx, 10, token, outboxstore.AggregateKey{}, 10); err != nil || len(h.Claimed) != 1 || h.Claimed[0].ID != b[1] || h.Claimed[0].AggregateSeq.Int64 != 2 {
		t.Fatalf("claim heads after order 2's first event: %+v (%v), want its second", h, err)
	}
	store.OnFailed = outboxstore.SkipFailed
	if h, err = store.ClaimHeads(ctx, 10, token, outboxstore.AggregateKey{}, 10); err != nil || len(h.Claimed) != 1 || h.Claimed[0].ID != a[1] {
		t.Fatalf("claim heads past a failed event with on_failed skip: %+v (%v), want order 1's second", h, err)
	}
	// A window with nothing beyond it is not full.
	if w, err = store.ClaimRows(ctx, outboxstore.RowsClaim{N: 10, Token: token, After: c[0], Through: math.MaxInt64, Window: 3}); err != nil || w.Full || len(w.Claimed) != 0 || w.Newest != c[0] {
		t.Fatalf("claim above the newest row: %+v (%v), want nothing, not full", w, err)
	}
}

// writeOrders commits n events of one order in one transaction and returns
// their ids.
func writeOrders(t *testing.T, pool *pgxpool.Pool, n int, order string) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for range n {
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

// claimAll claims up to n due rows of the whole outbox.
func claimAll(ctx context.Context, t *testing.T, store *outboxstore.Store, n int, token pgtype.UUID) ([]outboxstore.Claimed, error) {
	t.Helper()
	w, err := store.ClaimRows(ctx, outboxstore.RowsClaim{N: n, Token: token, After: math.MinInt64, Through: math.MaxInt64})
	return w.Claimed, err
}
