package outboxstore_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
)

// The functions behind the events' origins hold their bounds: the last id
// read from the sequence itself (a RESTART leaves pg_sequence_last_value
// NULL, which would read as 0 and pass for a rewind), a new epoch that
// cannot relabel ids not handed out yet nor run the ids out, and origins
// numbered only when they read as origins and Postgres can vouch for them:
// an epoch this database began, or a registered database's (at most 100).
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
	number := func(origin string) (*int, error) {
		var n *int
		err := db.Pool.QueryRow(ctx, `SELECT fanout_origin_number($1)`, origin).Scan(&n)
		return n, err
	}
	// Another database's origins, once an operator registered it.
	if n, err := number("1/shop/1"); err == nil || !strings.Contains(err.Error(), "is not registered") {
		t.Fatalf("an origin of a database never registered: %v, %v, want refused", n, err)
	}
	if added, err := store.AllowOrigin(ctx, outbox.Database{System: 1, Name: "shop"}, "a test"); err != nil || !added {
		t.Fatalf("register 1/shop: %t, %v", added, err)
	}
	n, err = number("1/shop/1")
	if err != nil || n == nil {
		t.Fatalf("an origin of a registered database: %v, %v", n, err)
	}
	first := *n
	if n, err := number("1/shop/1"); err != nil || n == nil || *n != first {
		t.Fatalf("the same origin again: %v, %v, want %d", n, err, first)
	}
	// This database's: the epochs its outbox began, and no other.
	own, err := outbox.ReadDatabase(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := number(outbox.Origin{Database: own, Epoch: 2}.String()); err != nil || n == nil {
		t.Errorf("this database's epoch 2 (begun above): %v, %v", n, err)
	}
	if n, err := number(outbox.Origin{Database: own, Epoch: 3}.String()); err == nil || !strings.Contains(err.Error(), "began no epoch 3") {
		t.Errorf("an epoch this database's outbox never began: %v, %v, want refused", n, err)
	}
	// At most 100 epochs of a registered database: a role that numbers
	// made-up epochs cannot take the numbers the others need.
	if _, err := store.AllowOrigin(ctx, outbox.Database{System: 2, Name: "many"}, "a test"); err != nil {
		t.Fatal(err)
	}
	for epoch := 1; epoch <= 100; epoch++ {
		if n, err := number("2/many/" + strconv.Itoa(epoch)); err != nil || n == nil {
			t.Fatalf("epoch %d of 2/many: %v, %v", epoch, n, err)
		}
	}
	if n, err := number("2/many/101"); err != nil || n != nil {
		t.Errorf("a 101st epoch of 2/many: %v, %v, want none (NULL)", n, err)
	}
	if n, err := number("1/shop/2"); err != nil || n == nil {
		t.Errorf("another registered database's next epoch after 2/many's hundred: %v, %v", n, err)
	}
}

// A new epoch begins after every event recorded as published: begun
// lower, it would give published events a second identity, and the audit
// would publish them again under it (the relay's role began one at id 1,
// and the sales ledger counted 5 orders twice).
func TestANewEpochBeginsAfterEveryPublishedEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	ids := writeOrders(t, db.Pool, 6, "1")
	if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox_landings (stream, first_id, last_id, event_ids, seqs) VALUES ('EVENTS', $1, $2, ARRAY[$1, $2]::bigint[], '{1,2}')`, ids[0], ids[1]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET status = 'sent', published_at = now() WHERE id = $1`, ids[3]); err != nil {
		t.Fatal(err)
	}
	for _, first := range []int64{ids[0], ids[1], ids[3]} {
		if _, err := store.NewEpoch(ctx, 1, 2, first, 0, "a test"); err == nil || !strings.Contains(err.Error(), "published already") {
			t.Errorf("an epoch beginning at id %d, at or below a published event: %v, want refused", first, err)
		}
	}
	if got, err := store.NewEpoch(ctx, 1, 2, ids[4], 0, "a test"); err != nil || got != 2 {
		t.Errorf("an epoch beginning after every published event: %d, %v", got, err)
	}
}
