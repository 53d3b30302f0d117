// Command subscribers is the subscriber benchmark (`go tool task
// bench:subscribers`). From a stream holding 100k order.created events it
// measures, in one run: invoicing with 1 and with 2 instances (batched
// transactions, the default), the same handler the plain way (one
// transaction and one double ack per event) as the baseline, and cache
// invalidation over 100k product.updated events. Each figure is measured
// -runs times (default 3; the variants in a new order each round), each run
// after the database is settled (benchkit.Settle), and printed as the
// median and the range of the runs.
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"runtime"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/redis/go-redis/v9"
)

var (
	events   = flag.Int("events", 100_000, "events in the stream")
	redisURL = flag.String("redis", "redis://127.0.0.1:56379/15", "Redis URL (a database of its own: it is flushed)")
)

func main() { benchkit.Main(run) }

type bench struct{ *benchkit.Pipeline }

func run(ctx context.Context) error {
	p, err := benchkit.Open(ctx, "SUB", 16)
	if err != nil {
		return err
	}
	defer p.Close()
	b, cfg := &bench{p}, p.Config

	fmt.Printf("subscriber benchmark, %s, GOMAXPROCS=%d, %d events per run, %d workers per instance\n\n",
		time.Now().Format(time.RFC3339), runtime.GOMAXPROCS(0), *events, cfg.Subscribers.Concurrency)
	start := time.Now()
	if err := b.fill(ctx); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	fmt.Printf("setup: %d orders and %d order.created + %d product.updated events in the stream (%.1fs)\n\n", *events, *events, *events, time.Since(start).Seconds())

	type run struct {
		name      string
		instances int
		batch     int
	}
	runs := []run{
		{"invoicing, 1 instance (batched transactions, batch_size 100)", 1, 100},
		{"invoicing, 2 instances (batched transactions, batch_size 100)", 2, 100},
		{"baseline: one transaction + one double ack per event, 1 instance", 1, 1},
	}
	// A first pass warms what a settled database still has cold (its caches,
	// the query plans, the pools, the consumer's first fetches): measured, it
	// read half the next pass's rate.
	warm, err := b.invoicing(ctx, 1, 100)
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	fmt.Printf("    warm-up pass (not counted): invoicing %.0f events/s\n", warm)
	rates := make([]benchkit.Figure, len(runs))
	var overBaseline, twoOverOne, cache benchkit.Figure
	for round := range *benchkit.Runs {
		got := make([]float64, len(runs))
		for _, i := range benchkit.Rotation(round, len(runs)) {
			if got[i], err = b.invoicing(ctx, runs[i].instances, runs[i].batch); err != nil {
				return fmt.Errorf("%s: %w", runs[i].name, err)
			}
			rates[i].Add(got[i])
		}
		overBaseline.Add(got[0] / got[2])
		twoOverOne.Add(got[1] / got[0])
		rate, err := b.cacheInvalidation(ctx)
		if err != nil {
			return fmt.Errorf("cache invalidation: %w", err)
		}
		cache.Add(rate)
		fmt.Printf("    round %d of %d: invoicing %.0f, %.0f, baseline %.0f, cache %.0f events/s\n", round+1, *benchkit.Runs, got[0], got[1], got[2], rate)
	}
	fmt.Println()
	for i, r := range runs {
		fmt.Printf("%-68s %s\n", r.name, rates[i].Format("%.0f events/s"))
	}
	fmt.Printf("    1 instance / baseline = %s (target >= 3x), 2 instances / 1 instance = %s\n\n", overBaseline.Format("%.1fx"), twoOverOne.Format("%.2fx"))
	fmt.Printf("%-68s %s\n", "cache invalidation, 1 instance", cache.Format("%.0f events/s"))
	return nil
}

// fill creates the orders and publishes their events through a relay.
func (b *bench) fill(ctx context.Context) error {
	if _, err := shop.Seed(ctx, b.Pool, 1000, rand.New(rand.NewPCG(1, 1))); err != nil {
		return err
	}
	// The seed's product.created events are not part of the benchmark.
	if _, err := b.Pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
		return err
	}
	_, err := b.Pool.Exec(ctx, `
WITH o AS (
    INSERT INTO orders (customer) SELECT 'bench-' || g FROM generate_series(1, $1) g RETURNING id
), l AS (
    INSERT INTO order_lines (order_id, line_no, product_id, quantity, unit_price)
    SELECT o.id, n, (SELECT min(id) FROM products) + (o.id * 7 + n) % 1000, 1 + n, 9.99 * n
    FROM o, generate_series(1, 2) n
)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', o.id::text, 'order.created', jsonb_build_object('order_id', o.id, 'customer', 'bench', 'lines', 2) FROM o`, *events)
	if err != nil {
		return err
	}
	_, err = b.Pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'product', p.id::text, 'product.updated', jsonb_build_object('product_id', p.id, 'price_cents', 1000 + g)
FROM generate_series(1, $1) g JOIN products p ON p.id = (SELECT min(id) FROM products) + g % 1000`, *events)
	if err != nil {
		return err
	}
	return b.Publish(ctx)
}

// measure forgets every invoice, checkpoint and consumer (benchkit's
// Reset), runs instances of the subscriber until they have drained the
// stream, and returns events/s.
func (b *bench) measure(ctx context.Context, instances int, opts subscribers.Options, handler func() subscribers.Handler) (float64, error) {
	name := opts.Declaration.Name
	if err := b.Reset(ctx, name, "invoice_lines", "invoices", "processed_events"); err != nil {
		return 0, err
	}
	took, err := b.TimeDrain(ctx, instances, opts, handler)
	if err == nil {
		err = b.CheckCheckpointed(ctx, name, *events)
	}
	return float64(*events) / took.Seconds(), err
}

func (b *bench) invoicing(ctx context.Context, instances, batch int) (float64, error) {
	sc := b.Config.Subscribers
	sc.BatchSize = batch
	opts := subscribers.Options{Declaration: invoicing.Subscriber, Config: sc}
	rate, err := b.measure(ctx, instances, opts, func() subscribers.Handler { return subscribers.Tx(invoicing.New()) })
	if err != nil {
		return 0, err
	}
	var invoices int
	if err := b.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&invoices); err != nil || invoices != *events {
		return 0, fmt.Errorf("%d invoices for %d orders (%v)", invoices, *events, err)
	}
	return rate, nil
}

func (b *bench) cacheInvalidation(ctx context.Context) (float64, error) {
	opts, err := redis.ParseURL(*redisURL)
	if err != nil {
		return 0, err
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		return 0, fmt.Errorf("redis at %s: %w", opts.Addr, err)
	}
	cache := cacheinval.NewCache(rdb, b.Pool, 2*time.Second, 10*time.Second)
	return b.measure(ctx, 1, subscribers.Options{Declaration: cacheinval.Subscriber, Config: b.Config.Subscribers},
		func() subscribers.Handler { return subscribers.Each(cacheinval.New(cache, b.Pool)) })
}
