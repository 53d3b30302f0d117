package outboxstore_test

import (
	"context"
	"strings"
	"testing"

	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
)

// The functions behind the events' origins hold their bounds: the last id
// read from the sequence itself (a RESTART leaves pg_sequence_last_value
// NULL, which would read as 0 and pass for a rewind), a new epoch that
// cannot relabel ids not handed out yet nor run the ids out, and origins
// numbered only when they read as origins.
func TestOriginFunctionsHoldTheirBounds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	writeOrders(t, db.Pool, 3, "1")
	last := func() int64 {
		t.Helper()
		id, err := store.LastID(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	if got := last(); got != 3 {
		t.Fatalf("last id %d after 3 rows, want 3", got)
	}
	if _, err := db.Pool.Exec(ctx, `ALTER TABLE outbox ALTER COLUMN id RESTART WITH 1000`); err != nil {
		t.Fatal(err)
	}
	if got := last(); got != 999 {
		t.Fatalf("last id %d after RESTART WITH 1000, want 999", got)
	}
	ident, lastID, err := store.State(ctx)
	if err != nil || lastID != 999 || ident.Latest().N != 1 {
		t.Fatalf("state: %+v, last id %d, %v", ident, lastID, err)
	}

	for _, c := range []struct {
		first, past int64
		want        string
	}{
		{first: 1001, past: 0, want: "past the next id"},
		{first: 500, past: 1 << 48, want: "between 0 and 2^48"},
	} {
		if _, err := store.NewEpoch(ctx, 1, 2, c.first, c.past, "a test"); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("new epoch at %d past %d: %v, want refused (%s)", c.first, c.past, err, c.want)
		}
	}
	// A new epoch never moves the ids back.
	if got, err := store.NewEpoch(ctx, 1, 2, 1000, 10, "a test"); err != nil || got != 2 {
		t.Fatalf("new epoch: %d, %v", got, err)
	}
	if got := last(); got != 999 {
		t.Fatalf("last id %d after an epoch whose past is below it, want 999", got)
	}

	var n *int
	for _, bad := range []string{"", "not an origin", "1/shop", "1/shop/0", "x/shop/1", "1/a/b/1"} {
		if err := db.Pool.QueryRow(ctx, `SELECT fanout_origin_number($1)`, bad).Scan(&n); err == nil || !strings.Contains(err.Error(), "not an origin") {
			t.Errorf("origin %q numbered: %v", bad, err)
		}
	}
	if err := db.Pool.QueryRow(ctx, `SELECT fanout_origin_number('1/shop/1')`).Scan(&n); err != nil || n == nil {
		t.Fatalf("a real origin: %v, %v", n, err)
	}
	first := *n
	if err := db.Pool.QueryRow(ctx, `SELECT fanout_origin_number('1/shop/1')`).Scan(&n); err != nil || n == nil || *n != first {
		t.Fatalf("the same origin again: %v, %v, want %d", n, err, first)
	}
}
