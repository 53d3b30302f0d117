package orderstatus_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/orderstatus"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Compare is the fault run's check of a backfill: it must report each kind
// of wrong copy (lost, regressed, a copy of nothing) and nothing for a
// right one.
func TestCompareReportsEveryKindOfWrongCopy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	pool := db.Pool
	if err := orderstatus.CreateTable(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := shop.Seed(ctx, pool, 3, rand.New(rand.NewPCG(1, 2))); err != nil {
		t.Fatal(err)
	}
	var product int64
	if err := pool.QueryRow(ctx, `SELECT min(id) FROM products`).Scan(&product); err != nil {
		t.Fatal(err)
	}
	var orders []int64
	for i := range 3 {
		inTx(t, pool, func(tx pgx.Tx) error {
			id, _, err := shop.CreateOrder(ctx, tx, "c", []shop.OrderLine{{ProductID: product, Quantity: 1}})
			if err == nil && i > 0 {
				_, err = shop.PayOrder(ctx, tx, id)
			}
			orders = append(orders, id)
			return err
		})
	}
	h := &orderstatus.Handler{}
	for _, id := range orders {
		inTx(t, pool, func(tx pgx.Tx) error { return h.HandleTx(ctx, tx, orderEvent(id)) })
	}
	if diffs := compare(t, pool); len(diffs) > 0 {
		t.Fatalf("a right copy: %v", diffs)
	}

	// A regressed copy, a lost one, and a copy of nothing.
	inTx(t, pool, func(tx pgx.Tx) error { return orderstatus.Overwrite(ctx, tx, orders[1], shop.StatusCreated, 1) })
	if _, err := pool.Exec(ctx, `DELETE FROM order_status_copy WHERE order_id = $1`, orders[2]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO order_status_copy VALUES (987654, 'paid', 2)`); err != nil {
		t.Fatal(err)
	}
	want := []string{
		fmt.Sprintf("order %d is paid (version 2), its copy created (version 1)", orders[1]),
		fmt.Sprintf("order %d (paid, version 2) missing from the copy", orders[2]),
		"order 987654 is not in Postgres, its copy paid (version 2)",
	}
	if got := compare(t, pool); !slices.Equal(got, want) {
		t.Fatalf("Compare found\n%q\nwant\n%q", got, want)
	}

	// The events again mend the first two.
	for _, id := range orders {
		inTx(t, pool, func(tx pgx.Tx) error { return h.HandleTx(ctx, tx, orderEvent(id)) })
	}
	if got := compare(t, pool); !slices.Equal(got, want[2:]) {
		t.Fatalf("after the events again, Compare found %q, want %q", got, want[2:])
	}
}

// An event that names no order, or one Postgres does not have, is the
// handler's verdict (the dead letters), never a retry.
func TestBadEventsArePermanent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	if err := orderstatus.CreateTable(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	h := &orderstatus.Handler{}
	for _, ev := range []subscribers.Event{
		{ID: 1, Payload: []byte(`{"order_id": "forty-two"}`)},
		{ID: 2, Payload: []byte(`not json`)},
		orderEvent(123456789),
	} {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		err = h.HandleTx(ctx, tx, ev)
		_ = tx.Rollback(ctx)
		if !subscribers.IsPermanent(err) {
			t.Errorf("event %s: %v, want a permanent error", ev.Payload, err)
		}
		if ev.ID < 3 && !errors.Is(err, orderstatus.ErrMalformed) {
			t.Errorf("event %s: %v, want %v", ev.Payload, err, orderstatus.ErrMalformed)
		}
	}
}

func orderEvent(id int64) subscribers.Event {
	return subscribers.Event{ID: id, Type: shop.OrderCreated, Payload: fmt.Appendf(nil, `{"order_id": %d}`, id)}
}

func compare(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	diffs, err := orderstatus.Compare(context.Background(), pool, 10)
	if err != nil {
		t.Fatal(err)
	}
	return diffs
}

func inTx(t *testing.T, pool *pgxpool.Pool, fn func(pgx.Tx) error) {
	t.Helper()
	if err := pgx.BeginFunc(context.Background(), pool, fn); err != nil {
		t.Fatal(err)
	}
}
