package invoicing_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
)

// Invoicing starts after the stream has dropped the order.created events
// of its oldest orders (stream.max_age): the live subscriber
// invoices what the stream still holds and what writers add meanwhile, the
// backfill the rest, and every order ends with exactly one invoice whose
// total is its lines'.
func TestBackfillInvoicesOrdersOlderThanTheStream(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	seedCatalog(t, env)
	ctx := context.Background()
	writeOrders := func(n int) []int64 {
		var ids []int64
		for range n {
			ids = append(ids, env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
				id, err := insertOrder(ctx, tx)
				return []outbox.Event{orderEvent(id)}, err
			})...)
		}
		return ids
	}
	old := writeOrders(400)
	env.WaitSent(old...)
	env.ExpireStream()                     // as stream.max_age does
	old = append(old, writeOrders(100)...) // and these are still in it
	env.WaitSent(old...)

	env.StartRunner(invoicing.Subscriber, nil)
	env.WaitIdle(invoicing.Name, 30*time.Second)
	var uninvoiced int
	if err := env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM orders o WHERE NOT EXISTS (SELECT FROM invoices i WHERE i.order_id = o.id)`).Scan(&uninvoiced); err != nil {
		t.Fatal(err)
	}
	if uninvoiced != 400 {
		t.Fatalf("from the stream alone, %d orders without an invoice; want the 400 whose events it dropped", uninvoiced)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !stop.Load() {
			writeOrders(1)
			time.Sleep(5 * time.Millisecond)
		}
	})
	cfg := env.Config.Subscribers
	s, err := backfill.Run(ctx, backfill.Options{Declaration: invoicing.Subscriber,
		Handler: subscribers.Tx(invoicing.New()), Config: cfg, Pool: env.DB.Pool, Logger: env.Logger, Chunk: 50, Rate: 2000})
	stop.Store(true)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if !s.Finished() || s.Failed != 0 || s.Done < 500 {
		t.Fatalf("backfill %+v, want finished, at least the 500 orders written before it done, none failed", s)
	}
	env.WaitAllSent()
	env.WaitIdle(invoicing.Name, 30*time.Second)
	var orders, twice, wrongTotal int
	err = env.DB.Pool.QueryRow(ctx, `
WITH per_order AS (
    SELECT o.id, count(i.id) AS invoices,
           bool_or(i.total <> (SELECT sum(quantity * unit_price) FROM order_lines l WHERE l.order_id = o.id)) AS wrong
    FROM orders o LEFT JOIN invoices i ON i.order_id = o.id GROUP BY o.id)
SELECT count(*), count(*) FILTER (WHERE invoices = 0), count(*) FILTER (WHERE invoices > 1), count(*) FILTER (WHERE wrong)
FROM per_order`).Scan(&orders, &uninvoiced, &twice, &wrongTotal)
	if err != nil {
		t.Fatal(err)
	}
	if uninvoiced != 0 || twice != 0 || wrongTotal != 0 || orders <= 500 {
		var missing []int64
		rows, _ := env.DB.Pool.Query(ctx, `SELECT o.id FROM orders o WHERE NOT EXISTS (SELECT FROM invoices i WHERE i.order_id = o.id) ORDER BY 1 LIMIT 10`)
		missing, _ = pgx.CollectRows(rows, pgx.RowTo[int64])
		t.Fatalf("%d orders: %d without an invoice %v (the backfill went to %d), %d with more than one, %d with a wrong total",
			orders, uninvoiced, missing, s.HighKey, twice, wrongTotal)
	}
	if n := len(env.DeadLetters(invoicing.Name)); n != 0 {
		t.Errorf("%d dead letters", n)
	}
	t.Logf("%d orders, %d written during the backfill; the backfill did %d rows", orders, orders-500, s.Done)
}
