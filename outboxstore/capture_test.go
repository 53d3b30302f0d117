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
)

// A wal relay's record of its slot, on a database of its own: read without
// making one, made by the first relay to ask (at the highest id then),
// replaced for a new slot, and done only for the bound it was made with;
// and the rows a poll relay marks sent when it takes over are the pending
// ones its snapshot shows, above the bound it gives. (The relay's tests
// run these through a real slot: TestSwitchingCaptureUnderLoad.)
func TestCaptureRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	const slot = "fanout_test_slot"

	if _, _, ok, err := store.ReadCapture(ctx, slot); err != nil || ok {
		t.Fatalf("read a record never made: ok %t (%v)", ok, err)
	}
	ids := writeOrders(t, db.Pool, 3, "1")
	b, err := store.CaptureBacklog(ctx, slot)
	if err != nil || b.Through != ids[2] || b.Done || b.Snapshot == "" {
		t.Fatalf("first CaptureBacklog: %+v (%v); want through %d, not done, with its snapshot", b, err, ids[2])
	}
	more := writeOrders(t, db.Pool, 1, "2")
	if again, err := store.CaptureBacklog(ctx, slot); err != nil || again != b {
		t.Fatalf("CaptureBacklog again: %+v (%v); want the record made first, %+v", again, err, b)
	}
	if err := store.StartCapture(ctx, slot); err != nil {
		t.Fatal(err)
	}
	if err := store.CaptureBacklogDone(ctx, slot, ids[2]); err != nil {
		t.Fatal(err)
	}
	through, done, ok, err := store.ReadCapture(ctx, slot)
	if err != nil || !ok || through != more[0] || done {
		t.Fatalf("after a new slot and the old bound's drain: through %d, done %t, ok %t (%v); want %d, not done", through, done, ok, err, more[0])
	}
	if err := store.CaptureBacklogDone(ctx, slot, more[0]); err != nil {
		t.Fatal(err)
	}
	if _, done, _, err := store.ReadCapture(ctx, slot); err != nil || !done {
		t.Fatalf("after the drain of its own bound: done %t (%v)", done, err)
	}

	first, last, oldest, err := store.PendingSpan(ctx)
	if err != nil || first != ids[0] || last != more[0] || oldest.IsZero() {
		t.Fatalf("pending span: %d..%d, oldest %s (%v); want %d..%d", first, last, oldest, err, ids[0], more[0])
	}

	var snap string
	if err := db.Pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(&snap); err != nil {
		t.Fatal(err)
	}
	after := writeOrders(t, db.Pool, 1, "3") // not in the snapshot
	if n, err := store.MarkCapturedSent(ctx, snap, ids[0]); err != nil || n != 3 {
		t.Fatalf("mark above the first id: %d rows (%v); want 3", n, err)
	}
	if n, err := store.MarkCapturedSent(ctx, snap, math.MinInt64); err != nil || n != 1 {
		t.Fatalf("mark all the snapshot shows: %d rows (%v); want the first row only", n, err)
	}
	if b, err := store.Backlog(ctx); err != nil || b.Pending != 1 {
		t.Fatalf("backlog: %+v (%v); want the row written after the snapshot (%d) pending", b, err, after[0])
	}
}

// A slot's backlog by writer transactions: a transaction in flight when
// the bound was read has rows below it, yet commits after the slot
// existed, so the slot decodes it whole. The backlog's snapshot leaves it
// out of the transactions a wal relay claims from the backlog and of the
// rows it waits for; the id bound alone would take it in.
func TestSlotBacklogByTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	const slot = "fanout_test_slot"

	inFlight, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer inFlight.Rollback(ctx)
	var late []int64
	for range 2 {
		id, err := outbox.Write(ctx, inFlight, outbox.Event{AggregateType: "order", AggregateID: "7", Type: "order.created", Payload: json.RawMessage(`{}`)})
		if err != nil {
			t.Fatal(err)
		}
		late = append(late, id)
	}
	committed := writeOrders(t, db.Pool, 2, "8")
	b, err := store.CaptureBacklog(ctx, slot)
	if err != nil {
		t.Fatal(err)
	}
	if err := inFlight.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	after := writeOrders(t, db.Pool, 1, "9")
	if b.Through != committed[1] || late[1] >= b.Through {
		t.Fatalf("backlog through %d; want %d, above the in-flight transaction's rows %v", b.Through, committed[1], late)
	}

	firsts := func(in *outboxstore.SlotBacklog) []int64 {
		t.Helper()
		w, err := store.TransactionCandidates(ctx, math.MinInt64, in, 100, 10)
		if err != nil {
			t.Fatal(err)
		}
		var got []int64
		for _, c := range w.Candidates {
			got = append(got, c.First)
		}
		return got
	}
	if got, want := firsts(&b), []int64{committed[0]}; !slices.Equal(got, want) {
		t.Errorf("the backlog's transactions start at %v, want %v: only the one committed before the bound was read", got, want)
	}
	if got, want := firsts(&outboxstore.SlotBacklog{Through: b.Through}), []int64{late[0], committed[0]}; !slices.Equal(got, want) {
		t.Errorf("up to the bound without the snapshot, transactions start at %v, want %v", got, want)
	}
	if got, want := firsts(nil), []int64{late[0], committed[0], after[0]}; !slices.Equal(got, want) {
		t.Errorf("the outbox's transactions start at %v, want %v", got, want)
	}
	for _, tc := range []struct {
		snapshot string
		want     int64
	}{{b.Snapshot, 2}, {"", 4}} {
		if n, err := store.UnsentThrough(ctx, b.Through, tc.snapshot); err != nil || n != tc.want {
			t.Errorf("unsent through %d in snapshot %q: %d (%v), want %d", b.Through, tc.snapshot, n, err, tc.want)
		}
	}
}
