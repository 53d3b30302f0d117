// Command ordering is the ordered subscriber benchmark (`go tool task
// bench:ordering`). From a stream holding the whole lives of -orders
// orders (created, paid, shipped, delivered: 4 events per aggregate, the
// aggregates interleaved as writers would interleave them) it measures the
// fulfilment subscriber ordered (as it is declared) with 1 and with 2
// instances, against the same handler declared unordered with 1 and 2
// instances. Target: ordered at least half of unordered. Each figure is
// measured -runs times (default 3; the variants in a new order each round)
// and printed as the median and the range.
package main

import (
	"context"
	"flag"
	"fmt"
	"runtime"
	"strings"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/fulfilment"
)

var orders = flag.Int("orders", 10_000, "orders (aggregates), 4 events each")

func main() { benchkit.Main(run) }

type bench struct{ *benchkit.Pipeline }

func run(ctx context.Context) error {
	p, err := benchkit.Open(ctx, "ORD", 16)
	if err != nil {
		return err
	}
	defer p.Close()
	b, cfg := &bench{p}, p.Config

	events := 4 * *orders
	fmt.Printf("ordering benchmark, %s, GOMAXPROCS=%d, %d orders (aggregates), %d events per run, %d workers per instance, batch_size %d\n\n",
		time.Now().Format(time.RFC3339), runtime.GOMAXPROCS(0), *orders, events, cfg.Subscribers.Concurrency, cfg.Subscribers.BatchSize)
	start := time.Now()
	if err := b.fill(ctx); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	fmt.Printf("setup: %d events in the stream (%.1fs)\n\n", events, time.Since(start).Seconds())

	type variant struct {
		name      string
		ordered   bool
		instances int
	}
	variants := []variant{
		{"fulfilment ordered, 1 instance", true, 1},
		{"fulfilment ordered, 2 instances (one pinned, one standby)", true, 2},
		{"same handler unordered, 1 instance", false, 1},
		{"same handler unordered, 2 instances", false, 2},
	}
	warm, err := b.fulfil(ctx, true, 1)
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	fmt.Printf("    warm-up pass (not counted): ordered %.0f events/s\n", warm)
	rates := make([]benchkit.Figure, len(variants))
	var ratio1, ratio2 benchkit.Figure
	for round := range *benchkit.Runs {
		got := make([]float64, len(variants))
		for _, i := range benchkit.Rotation(round, len(variants)) {
			v := variants[i]
			if got[i], err = b.fulfil(ctx, v.ordered, v.instances); err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			rates[i].Add(got[i])
		}
		ratio1.Add(got[0] / got[2])
		ratio2.Add(got[1] / got[3])
		fmt.Printf("    round %d of %d: ordered %.0f, %.0f; unordered %.0f, %.0f events/s\n", round+1, *benchkit.Runs, got[0], got[1], got[2], got[3])
	}
	fmt.Println()
	for i, v := range variants {
		fmt.Printf("%-72s %s\n", v.name, rates[i].Format("%.0f events/s"))
	}
	fmt.Printf("    ordered / unordered: 1 instance %s, 2 instances %s (target >= 0.5)\n", ratio1.Format("%.2f"), ratio2.Format("%.2f"))
	return nil
}

// fill writes the orders' whole lives, one step of every order after the
// other, each step published through a relay before the next is written:
// each aggregate's events are an order apart in the stream.
func (b *bench) fill(ctx context.Context) error {
	if _, err := b.Pool.Exec(ctx, `INSERT INTO orders (customer) SELECT 'bench-' || g FROM generate_series(1, $1) g`, *orders); err != nil {
		return err
	}
	steps := []struct{ from, to string }{{"", shop.StatusCreated}, {shop.StatusCreated, shop.StatusPaid}, {shop.StatusPaid, shop.StatusShipped}, {shop.StatusShipped, shop.StatusDelivered}}
	for n, s := range steps {
		_, err := b.Pool.Exec(ctx, `
WITH t AS (
    INSERT INTO order_transitions (order_id, n, from_status, to_status)
    SELECT id, $1, nullif($2, ''), $3 FROM orders ORDER BY id
    RETURNING order_id
)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', order_id::text, 'order.' || $3,
       CASE WHEN $1 = 1 THEN jsonb_build_object('order_id', order_id, 'customer', 'bench', 'lines', 1)
            ELSE jsonb_build_object('order_id', order_id, 'from', $2, 'to', $3, 'n', $1) END
FROM t ORDER BY order_id`, n+1, s.from, s.to)
		if err != nil {
			return err
		}
		// Published step by step: the relay publishes an aggregate's
		// waiting events one after the other, which would put each order's
		// life in one run of the stream.
		if err := b.Publish(ctx); err != nil {
			return err
		}
	}
	_, err := b.Pool.Exec(ctx, `UPDATE orders SET status = 'delivered'`)
	return err
}

// fulfil runs the fulfilment handler, ordered or not, on instances
// instances until the stream is drained, from its start on a settled
// database, and returns events/s. An ordered run must have applied every
// order's history, with no violation.
func (b *bench) fulfil(ctx context.Context, ordered bool, instances int) (float64, error) {
	err := b.Reset(ctx, fulfilment.Name, "fulfilment_orders", "fulfilment_history", "fulfilment_violations", "processed_events", "subscriber_aggregates")
	if err != nil {
		return 0, err
	}
	d := fulfilment.Subscriber
	d.Ordered = ordered
	opts := subscribers.Options{Declaration: d, Config: b.Config.Subscribers}
	took, err := b.TimeDrain(ctx, instances, opts, func() subscribers.Handler { return subscribers.Tx(fulfilment.New()) })
	if err != nil {
		return 0, err
	}
	if err := b.CheckCheckpointed(ctx, fulfilment.Name, 4**orders); err != nil {
		return 0, err
	}
	var violations, redelivered int
	if err := b.Pool.QueryRow(ctx, `SELECT count(*) FROM fulfilment_violations`).Scan(&violations); err != nil {
		return 0, err
	}
	if c, err := b.JS.Consumer(ctx, b.Config.Stream.Name, fulfilment.Name); err == nil {
		redelivered = c.CachedInfo().NumRedelivered
	}
	fmt.Printf("      ordered %t, instances %d: %s, %d violations recorded, %d redelivered\n", ordered, instances, took.Round(time.Millisecond), violations, redelivered)
	if ordered {
		diffs, err := fulfilment.Compare(ctx, b.Pool, 5)
		if err != nil {
			return 0, err
		}
		if len(diffs) > 0 {
			return 0, fmt.Errorf("the ordered run differs from the orders' history:\n%s", strings.Join(diffs, "\n"))
		}
	}
	return float64(4**orders) / took.Seconds(), nil
}
