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
	"os"
	"runtime"
	"strconv"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

var (
	events   = flag.Int("events", 100_000, "events in the stream")
	natsURL  = flag.String("nats", connect.DefaultNATSURL, "nats-server URL")
	redisURL = flag.String("redis", "redis://127.0.0.1:56379/15", "Redis URL (a database of its own: it is flushed)")
	adminURL = flag.String("postgres", pgtest.AdminURL(), "superuser URL to create the benchmark database")
)

var quiet = benchkit.Quiet

func main() {
	flag.Parse()
	if err := run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type bench struct {
	cfg  *benchkit.Config
	db   *pgtest.DB
	nc   *nats.Conn
	js   jetstream.JetStream
	pool *pgxpool.Pool
}

func run(ctx context.Context) error {
	if err := benchkit.CheckRuns(); err != nil {
		return err
	}
	cfg := benchkit.DefaultConfig()
	var err error
	suffix := strconv.FormatUint(rand.Uint64()%1_000_000_000, 36)
	cfg.Stream.Name = "BENCHSUB_" + suffix
	cfg.Stream.SubjectPrefix = "benchsub" + suffix
	cfg.Subscribers.DeadLetterStream = "BENCHSUB_DLQ_" + suffix
	cfg.Subscribers.DeadLetterSubjectPrefix = "benchsubdlq" + suffix
	b := &bench{cfg: cfg}
	if b.nc, err = nats.Connect(*natsURL); err != nil {
		return fmt.Errorf("connect to nats (start the services: go tool task services): %w", err)
	}
	defer b.nc.Close()
	if b.js, err = jetstream.New(b.nc); err != nil {
		return err
	}
	defer func() {
		_ = b.js.DeleteStream(context.Background(), cfg.Stream.Name)
		_ = b.js.DeleteStream(context.Background(), cfg.Subscribers.DeadLetterStream)
	}()
	if b.db, err = pgtest.Create(ctx, *adminURL); err != nil {
		return err
	}
	defer b.db.Close()
	pc, err := pgxpool.ParseConfig(b.db.URL)
	if err != nil {
		return err
	}
	pc.MaxConns = 16
	if b.pool, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
		return err
	}
	defer b.pool.Close()

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
		for k := range runs {
			i := (k + round) % len(runs)
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
	if _, err := shop.Seed(ctx, b.pool, 1000, rand.New(rand.NewPCG(1, 1))); err != nil {
		return err
	}
	// The seed's product.created events are not part of the benchmark.
	if _, err := b.pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
		return err
	}
	_, err := b.pool.Exec(ctx, `
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
	_, err = b.pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'product', p.id::text, 'product.updated', jsonb_build_object('product_id', p.id, 'price_cents', 1000 + g)
FROM generate_series(1, $1) g JOIN products p ON p.id = (SELECT min(id) FROM products) + g % 1000`, *events)
	if err != nil {
		return err
	}
	return benchkit.Publish(ctx, b.pool, b.nc, b.cfg.Relay, b.cfg.Stream)
}

// reset forgets every invoice, checkpoint and consumer, so the next run
// starts from the stream's first event, on a settled database.
func (b *bench) reset(ctx context.Context, consumer string) error {
	if err := b.js.DeleteConsumer(ctx, b.cfg.Stream.Name, consumer); err != nil && err != jetstream.ErrConsumerNotFound {
		return err
	}
	// Settled before the truncate, not after: without statistics on the
	// rows the setup wrote, the planner may scan order_lines once per batch
	// (5x slower) until autovacuum happens to analyze it mid-run, and the
	// last run's dirty pages would be written during this one. But an
	// empty table analyzed as empty (reltuples 0) makes every foreign-key
	// check of invoice_lines scan invoices, a plan each connection keeps
	// until autovacuum (a minute apart) analyzes the growing table: the
	// 1-instance figure then read 9k events/s in one round and 25k in the
	// next. Truncated after, the tables have no statistics (reltuples -1)
	// and the planner assumes a table of some size, as on a fresh install.
	if err := benchkit.Settle(ctx, b.pool); err != nil {
		return err
	}
	_, err := b.pool.Exec(ctx, `TRUNCATE invoice_lines, invoices, processed_events`)
	return err
}

// drain starts the runners and returns events/s once the consumer has
// nothing pending and nothing unacknowledged.
func (b *bench) drain(ctx context.Context, name string, runners []*subscribers.Runner, want int) (float64, error) {
	start := time.Now()
	for _, r := range runners {
		if err := r.Start(ctx); err != nil {
			return 0, err
		}
	}
	defer func() {
		for _, r := range runners {
			_ = r.Stop(ctx)
		}
	}()
	if err := benchkit.WaitDrained(ctx, b.js, b.cfg.Stream.Name, name, 15*time.Minute); err != nil {
		return 0, err
	}
	took := time.Since(start)
	var done int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE subscriber = $1`, name).Scan(&done); err != nil {
		return 0, err
	}
	if done != want {
		return 0, fmt.Errorf("%d events checkpointed, want %d", done, want)
	}
	return float64(want) / took.Seconds(), nil
}

func (b *bench) invoicing(ctx context.Context, instances, batch int) (float64, error) {
	if err := b.reset(ctx, invoicing.Name); err != nil {
		return 0, err
	}
	sc := b.cfg.Subscribers
	sc.BatchSize = batch
	var runners []*subscribers.Runner
	for range instances {
		nc, err := nats.Connect(*natsURL)
		if err != nil {
			return 0, err
		}
		defer nc.Close()
		r, err := subscribers.New(subscribers.Options{Declaration: invoicing.Subscriber, Handler: subscribers.Tx(invoicing.New()), Config: sc, Stream: b.cfg.Stream, Pool: b.pool, Conn: nc, Logger: quiet})
		if err != nil {
			return 0, err
		}
		runners = append(runners, r)
	}
	rate, err := b.drain(ctx, invoicing.Name, runners, *events)
	if err != nil {
		return 0, err
	}
	var invoices int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&invoices); err != nil || invoices != *events {
		return 0, fmt.Errorf("%d invoices for %d orders (%v)", invoices, *events, err)
	}
	return rate, nil
}

func (b *bench) cacheInvalidation(ctx context.Context) (float64, error) {
	if err := b.reset(ctx, cacheinval.Name); err != nil {
		return 0, err
	}
	opts, err := redis.ParseURL(*redisURL)
	if err != nil {
		return 0, err
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		return 0, fmt.Errorf("redis at %s: %w", opts.Addr, err)
	}
	cache := cacheinval.NewCache(rdb, b.pool, 2*time.Second, 10*time.Second)
	r, err := subscribers.New(subscribers.Options{Declaration: cacheinval.Subscriber, Handler: subscribers.Each(cacheinval.New(cache, b.pool)), Config: b.cfg.Subscribers, Stream: b.cfg.Stream,
		Pool: b.pool, Conn: b.nc, Logger: quiet})
	if err != nil {
		return 0, err
	}
	return b.drain(ctx, cacheinval.Name, []*subscribers.Runner{r}, *events)
}
