package outbox_test

import (
	"context"
	"math"
	"testing"

	"github.com/fanout/fanout/internal/testenv/pgtest"
	"github.com/fanout/fanout/outbox"
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
	store := outbox.NewStore(db.Pool)
	const slot = "fanout_test_slot"

	if _, _, ok, err := store.ReadCapture(ctx, slot); err != nil || ok {
		t.Fatalf("read a record never made: ok %t (%v)", ok, err)
	}
	ids := writeOrders(t, db.Pool, 3, "1")
	through, done, err := store.CaptureBacklog(ctx, slot)
	if err != nil || through != ids[2] || done {
		t.Fatalf("first CaptureBacklog: through %d, done %t (%v); want %d, not done", through, done, err, ids[2])
	}
	more := writeOrders(t, db.Pool, 1, "2")
	if through, _, err := store.CaptureBacklog(ctx, slot); err != nil || through != ids[2] {
		t.Fatalf("CaptureBacklog again: through %d (%v); want the bound recorded first, %d", through, err, ids[2])
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
