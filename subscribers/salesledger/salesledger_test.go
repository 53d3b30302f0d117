package salesledger_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func seedCatalog(t *testing.T, env *subscribertest.Env) {
	t.Helper()
	if _, err := shop.Seed(context.Background(), env.DB.Pool, 5, rand.New(rand.NewPCG(7, 7))); err != nil {
		t.Fatal(err)
	}
}

// insertOrder writes an order of 3 units (2 + 1) of the first product.
func insertOrder(ctx context.Context, tx pgx.Tx) (int64, error) {
	var orderID int64
	err := tx.QueryRow(ctx, `
WITH o AS (INSERT INTO orders (customer) VALUES ('test') RETURNING id),
     p AS (SELECT min(id) AS id FROM products),
     l AS (INSERT INTO order_lines (order_id, line_no, product_id, quantity, unit_price)
           SELECT o.id, n, p.id, 3 - n, 10.50 FROM o, p, generate_series(1, 2) n)
SELECT id FROM o`).Scan(&orderID)
	return orderID, err
}

func orderEvent(orderID int64) outbox.Event {
	return outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: strconv.FormatInt(orderID, 10), Type: shop.OrderCreated,
		Payload: shop.OrderEvent{OrderID: orderID, Customer: "test", Lines: 2}}
}

func drift(t *testing.T, env *subscribertest.Env) []string {
	t.Helper()
	d, err := salesledger.Drift(context.Background(), env.DB.Pool)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestConformance(t *testing.T) {
	subscribertest.Run(t, subscribertest.Case{
		Subscriber: salesledger.Subscriber,
		Handler: func(env *subscribertest.Env) subscribers.Handler {
			seedCatalog(env.T, env)
			return subscribers.Tx(salesledger.New())
		},
		Valid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, error) {
			id, err := insertOrder(context.Background(), tx)
			return orderEvent(id), err
		},
		// Each handling adds 3 units: the effects are the units / 3.
		Effects: func(env *subscribertest.Env, ev outbox.Event, _ int64) int {
			var units int64
			err := env.DB.Pool.QueryRow(context.Background(), `SELECT coalesce(sum(units), 0) FROM product_sales`).Scan(&units)
			if err != nil {
				env.T.Fatal(err)
			}
			return int(units / 3)
		},
		Invalid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, string, error) {
			return outbox.Event{AggregateType: "order", AggregateID: "x", Type: shop.OrderCreated,
				Payload: []byte(`{"order_id": "not a number"}`)}, "malformed order.created payload", nil
		},
		// The ledger adds up: its checkpoint alone makes it exactly once.
		CheckpointOnly: true,
	})
}

// Two instances racing on a stream that holds duplicates (events stored
// twice under one id), with bad orders among the good: the ledger equals
// the order lines exactly, and the bad orders are dead-lettered.
func TestLedgerEqualsOrderLinesWithTwoInstancesAndDuplicates(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	seedCatalog(t, env)
	env.StartRunner(salesledger.Subscriber, nil)
	env.StartRunner(salesledger.Subscriber, nil)
	rows, err := env.DB.Pool.Query(context.Background(), `SELECT id FROM products ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	products, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(products) == 0 {
		t.Fatalf("products %v (%v)", products, err)
	}
	rng := rand.New(rand.NewPCG(3, 3))
	for range 10 {
		env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
			for range 20 {
				lines := []shop.OrderLine{
					{ProductID: products[rng.IntN(len(products))], Quantity: 1 + rng.IntN(4)},
					{ProductID: products[rng.IntN(len(products))], Quantity: 1},
				}
				if _, _, err := shop.CreateOrder(context.Background(), tx, "two", lines); err != nil {
					return nil, err
				}
			}
			return nil, nil
		})
	}
	bad := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		return []outbox.Event{orderEvent(987654321), {AggregateType: "order", AggregateID: "?", Type: shop.OrderCreated, Payload: []byte(`{"order_id": -1}`)}}, nil
	})
	env.Settle(salesledger.Name)
	rows, _ = env.DB.Pool.Query(context.Background(), `SELECT id FROM outbox WHERE event_type = 'order.created' AND status = 'sent' ORDER BY id LIMIT 40`)
	all, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range all {
		env.Republish(id)
	}
	env.WaitIdle(salesledger.Name, 30*time.Second)
	if d := drift(t, env); len(d) > 0 {
		t.Fatalf("the ledger drifted from the order lines: %s", strings.Join(d, "; "))
	}
	var orders int
	_ = env.DB.Pool.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&orders)
	if orders != 200 {
		t.Fatalf("%d orders, want 200 (the test proves less than it claims)", orders)
	}
	dead := env.DeadLetters(salesledger.Name)
	if len(dead) != len(bad) {
		t.Fatalf("%d dead letters, want the %d bad orders", len(dead), len(bad))
	}
	for _, d := range dead {
		r := d.Header.Get(subscribers.DeadReasonHeader)
		if !strings.Contains(r, salesledger.ErrUnknownOrder.Error()) && !strings.Contains(r, salesledger.ErrMalformed.Error()) {
			t.Errorf("dead letter reason %q", r)
		}
	}
}
