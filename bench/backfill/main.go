// Command backfill is the backfill benchmark (`go tool task
// bench:backfill`). Invoicing's backfill reads -orders orders (1,000,000
// by default) that have no invoice, while writers create -rate orders per
// second (500) with their order.created events, a relay publishes them
// and invoicing handles them live, as in production. Each run measures:
//
//   - the backfill's rows/s, from its start to its last chunk;
//   - the live freshness, a writer's commit to its order's invoice being
//     visible, p50 and p99: for -quiet before the backfill, then during it.
//
// Each figure is measured -runs times (default 3) and printed as the median
// and the range. Every run ends by checking that every order has exactly
// one invoice.
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/jackc/pgx/v5"
)

var (
	orders   = flag.Int("orders", 1_000_000, "orders without an invoice when the backfill starts")
	rate     = flag.Int("rate", 500, "orders the live writers create per second")
	quietFor = flag.Duration("quiet", 15*time.Second, "how long the live freshness is measured before the backfill")
	chunk    = flag.Int("chunk", backfill.DefaultChunk, "the backfill's rows per chunk (fanout backfill --chunk)")
	workers  = flag.Int("workers", backfill.DefaultWorkers, "the backfill's workers (fanout backfill --workers)")
	bfRate   = flag.Float64("backfill-rate", 0, "the backfill's rows per second (fanout backfill --rate; 0: no limit)")
)

func main() { benchkit.Main(run) }

type bench struct {
	*benchkit.Pipeline
	products []int64
}

func run(ctx context.Context) error {
	p, err := benchkit.Open(ctx, "BF", 24)
	if err != nil {
		return err
	}
	defer p.Close()
	p.Config.Subscribers.Start = "new"
	b := &bench{Pipeline: p}

	fmt.Printf("backfill benchmark, %s, GOMAXPROCS=%d: invoicing's backfill of %d orders (chunks of %d, %d workers) beside %d new orders/s handled live\n\n",
		time.Now().Format(time.RFC3339), runtime.GOMAXPROCS(0), *orders, *chunk, *workers, *rate)
	start := time.Now()
	if err := b.fill(ctx); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	fmt.Printf("setup: %d orders of 2 lines, none invoiced, no events (%.1fs)\n\n", *orders, time.Since(start).Seconds())

	var rows, quietP50, quietP99, busyP50, busyP99, ratio benchkit.Figure
	for round := range *benchkit.Runs {
		res, err := b.runOnce(ctx)
		if err != nil {
			return fmt.Errorf("run %d: %w", round+1, err)
		}
		rows.Add(res.rowsPerSec)
		quietP50.Add(benchkit.Ms(res.quiet.P50))
		quietP99.Add(benchkit.Ms(res.quiet.P99))
		busyP50.Add(benchkit.Ms(res.busy.P50))
		busyP99.Add(benchkit.Ms(res.busy.P99))
		ratio.Add(float64(res.busy.P99) / float64(res.quiet.P99))
		fmt.Printf("    run %d of %d: backfill %d rows in %.1fs, %.0f rows/s; freshness p50/p99 %s/%s quiet (%d orders), %s/%s during the backfill (%d orders)\n",
			round+1, *benchkit.Runs, res.rows, res.took.Seconds(), res.rowsPerSec,
			res.quiet.P50.Round(time.Millisecond), res.quiet.P99.Round(time.Millisecond), res.quiet.N,
			res.busy.P50.Round(time.Millisecond), res.busy.P99.Round(time.Millisecond), res.busy.N)
	}
	fmt.Println()
	fmt.Printf("%-58s %s (target >= 20000)\n", "backfill, invoicing (effect in Postgres)", rows.Format("%.0f rows/s"))
	fmt.Printf("%-58s p50 %s, p99 %s\n", fmt.Sprintf("live freshness at %d orders/s, no backfill", *rate), quietP50.Format("%.0f ms"), quietP99.Format("%.0f ms"))
	fmt.Printf("%-58s p50 %s, p99 %s\n", "live freshness during the backfill", busyP50.Format("%.0f ms"), busyP99.Format("%.0f ms"))
	fmt.Printf("    p99 during / p99 quiet = %s (target <= 2x)\n", ratio.Format("%.2fx"))
	return nil
}

// fill seeds a catalog and the orders, without events.
func (b *bench) fill(ctx context.Context) error {
	if _, err := shop.Seed(ctx, b.Pool, 1000, rand.New(rand.NewPCG(1, 1))); err != nil {
		return err
	}
	if _, err := b.Pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
		return err
	}
	for done := 0; done < *orders; done += 100_000 {
		_, err := b.Pool.Exec(ctx, `
WITH o AS (
    INSERT INTO orders (customer) SELECT 'bench-' || g FROM generate_series(1, $1) g RETURNING id
)
INSERT INTO order_lines (order_id, line_no, product_id, sku, name, quantity, unit_price)
SELECT o.id, n, p.id, p.sku, p.name, 1 + n, p.price
FROM o, generate_series(1, 2) n
JOIN LATERAL (SELECT id, sku, name, price FROM products ORDER BY id OFFSET (o.id * 7 + n) % 1000 LIMIT 1) p ON true`, min(100_000, *orders-done))
		if err != nil {
			return err
		}
	}
	rows, err := b.Pool.Query(ctx, `SELECT id FROM products ORDER BY id`)
	if err != nil {
		return err
	}
	if b.products, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		return err
	}
	return benchkit.Settle(ctx, b.Pool)
}

type result struct {
	rows        int64
	took        time.Duration
	rowsPerSec  float64
	quiet, busy benchkit.Latencies
}

// runOnce resets the invoices, runs the live pipeline with its writers for
// -quiet, then the backfill beside it, and checks the invoices.
func (b *bench) runOnce(ctx context.Context) (result, error) {
	var res result
	err := b.Reset(ctx, invoicing.Name, "invoice_lines", "invoices", "processed_events",
		"subscriber_backfill_segments", "subscriber_backfills", "subscriber_backfill_failures")
	if err != nil {
		return res, err
	}
	r, err := b.StartRelay(ctx, nil)
	if err != nil {
		return res, err
	}
	defer r.Stop(ctx) //nolint:errcheck
	sub, err := b.StartRunner(ctx, subscribers.Options{Declaration: invoicing.Subscriber, Handler: subscribers.Tx(invoicing.New()), Config: b.Config.Subscribers})
	if err != nil {
		return res, err
	}
	defer sub.Stop(ctx) //nolint:errcheck

	live := benchkit.NewPending() // order id -> commit
	liveCtx, stopLive := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { b.writeOrders(liveCtx, live) })
	wg.Go(func() { b.watchInvoices(liveCtx, live) })

	time.Sleep(*quietFor)
	res.quiet = benchkit.Quantiles(live.Take())

	start := time.Now()
	s, err := backfill.Run(ctx, backfill.Options{Declaration: invoicing.Subscriber,
		Handler: subscribers.Tx(invoicing.New()), Config: b.Config.Subscribers, Pool: b.Pool, Logger: benchkit.Quiet, Chunk: *chunk, Rate: *bfRate, Workers: *workers})
	res.took = time.Since(start)
	res.busy = benchkit.Quantiles(live.Take())
	stopLive()
	wg.Wait()
	if err != nil {
		return res, err
	}
	res.rows = s.Done
	res.rowsPerSec = float64(s.Done) / res.took.Seconds()
	if s.Failed != 0 || s.Done < int64(*orders) {
		return res, fmt.Errorf("backfill: %+v", s)
	}
	// Every order ends with one invoice, once the live events are
	// published and handled.
	if err := b.WaitSent(ctx, 2*time.Minute); err != nil {
		return res, fmt.Errorf("once the writers stopped: %w", err)
	}
	if err := b.WaitDrained(ctx, invoicing.Name, 2*time.Minute); err != nil {
		return res, err
	}
	var uninvoiced, twice int
	if err := b.Pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE n = 0), count(*) FILTER (WHERE n > 1)
FROM (SELECT count(i.id) AS n FROM orders o LEFT JOIN invoices i ON i.order_id = o.id GROUP BY o.id) per_order`).Scan(&uninvoiced, &twice); err != nil {
		return res, err
	}
	if uninvoiced != 0 || twice != 0 {
		var lo, hi int64
		_ = b.Pool.QueryRow(ctx, `SELECT min(o.id), max(o.id) FROM orders o WHERE NOT EXISTS (SELECT FROM invoices i WHERE i.order_id = o.id)`).Scan(&lo, &hi)
		return res, fmt.Errorf("%d orders without an invoice (ids %d to %d; the backfill went to %d), %d with more than one", uninvoiced, lo, hi, s.HighKey, twice)
	}
	return res, nil
}

// writeOrders writes orders at -rate, noting each one's commit.
func (b *bench) writeOrders(ctx context.Context, live *benchkit.Pending) {
	benchkit.Pace{Workers: 4, Rate: *rate, Seed: 13}.Run(ctx, func(_, _ int, rng *rand.Rand) {
		product := b.products[rng.IntN(len(b.products))]
		var id int64
		err := pgx.BeginFunc(ctx, b.Pool, func(tx pgx.Tx) error {
			var err error
			id, _, err = shop.CreateOrder(ctx, tx, "live", []shop.OrderLine{{ProductID: product, Quantity: 1}})
			return err
		})
		if err == nil {
			live.Committed(id)
		}
	})
}

// watchInvoices polls for the pending orders' invoices every 20 ms.
func (b *bench) watchInvoices(ctx context.Context, live *benchkit.Pending) {
	for ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
		ids := live.Keys()
		if len(ids) == 0 {
			continue
		}
		// Planned at each poll (not a prepared statement's plan, made
		// while invoices was empty: a scan of the whole table at every
		// poll once the backfill filled it).
		rows, err := b.Pool.Query(ctx, `SELECT order_id FROM invoices WHERE order_id = ANY($1)`, pgx.QueryExecModeExec, ids)
		if err != nil {
			continue
		}
		if seen, err := pgx.CollectRows(rows, pgx.RowTo[int64]); err == nil {
			live.Seen(time.Now(), seen...)
		}
	}
}
