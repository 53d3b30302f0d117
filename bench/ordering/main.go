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
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var (
	orders   = flag.Int("orders", 10_000, "orders (aggregates), 4 events each")
	natsURL  = flag.String("nats", connect.DefaultNATSURL, "nats-server URL")
	adminURL = flag.String("postgres", pgtest.AdminURL(), "superuser URL to create the benchmark database")
)

func main() {
	flag.Parse()
	if err := run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type bench struct {
	cfg  *benchkit.Config
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
	cfg.Stream.Name = "BENCHORD_" + suffix
	cfg.Stream.SubjectPrefix = "benchord" + suffix
	cfg.Subscribers.DeadLetterStream = "BENCHORD_DLQ_" + suffix
	cfg.Subscribers.DeadLetterSubjectPrefix = "benchorddlq" + suffix
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
	db, err := pgtest.Create(ctx, *adminURL)
	if err != nil {
		return err
	}
	defer db.Close()
	pc, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		return err
	}
	pc.MaxConns = 16
	if b.pool, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
		return err
	}
	defer b.pool.Close()

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
		for k := range variants {
			i := (k + round) % len(variants)
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
	if _, err := b.pool.Exec(ctx, `INSERT INTO orders (customer) SELECT 'bench-' || g FROM generate_series(1, $1) g`, *orders); err != nil {
		return err
	}
	steps := []struct{ from, to string }{{"", shop.StatusCreated}, {shop.StatusCreated, shop.StatusPaid}, {shop.StatusPaid, shop.StatusShipped}, {shop.StatusShipped, shop.StatusDelivered}}
	for n, s := range steps {
		_, err := b.pool.Exec(ctx, `
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
		if err := benchkit.Publish(ctx, b.pool, b.nc, b.cfg.Relay, b.cfg.Stream); err != nil {
			return err
		}
	}
	_, err := b.pool.Exec(ctx, `UPDATE orders SET status = 'delivered'`)
	return err
}

// reset forgets fulfilment's state, checkpoints and consumer: the next run
// starts from the stream's first event, on a settled database.
func (b *bench) reset(ctx context.Context) error {
	if err := b.js.DeleteConsumer(ctx, b.cfg.Stream.Name, fulfilment.Name); err != nil && err != jetstream.ErrConsumerNotFound {
		return err
	}
	if err := benchkit.Settle(ctx, b.pool); err != nil {
		return err
	}
	_, err := b.pool.Exec(ctx, `TRUNCATE fulfilment_orders, fulfilment_history, fulfilment_violations, processed_events, subscriber_aggregates`)
	return err
}

// fulfil runs the fulfilment handler, ordered or not, on instances
// instances until the stream is drained, and returns events/s. An ordered
// run must have applied every order's history, with no violation.
func (b *bench) fulfil(ctx context.Context, ordered bool, instances int) (float64, error) {
	if err := b.reset(ctx); err != nil {
		return 0, err
	}
	d := fulfilment.Subscriber
	d.Ordered = ordered
	var runners []*subscribers.Runner
	for range instances {
		nc, err := nats.Connect(*natsURL)
		if err != nil {
			return 0, err
		}
		defer nc.Close()
		r, err := subscribers.New(subscribers.Options{Declaration: d, Handler: subscribers.Tx(fulfilment.New()), Config: b.cfg.Subscribers, Stream: b.cfg.Stream, Pool: b.pool, Conn: nc, Logger: benchkit.Quiet})
		if err != nil {
			return 0, err
		}
		runners = append(runners, r)
	}
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
	if err := benchkit.WaitDrained(ctx, b.js, b.cfg.Stream.Name, fulfilment.Name, 15*time.Minute); err != nil {
		return 0, err
	}
	took := time.Since(start)
	var done int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE subscriber = $1`, fulfilment.Name).Scan(&done); err != nil {
		return 0, err
	}
	if done != 4**orders {
		return 0, fmt.Errorf("%d events checkpointed, want %d", done, 4**orders)
	}
	var violations, redelivered int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM fulfilment_violations`).Scan(&violations); err != nil {
		return 0, err
	}
	if c, err := b.js.Consumer(ctx, b.cfg.Stream.Name, fulfilment.Name); err == nil {
		redelivered = c.CachedInfo().NumRedelivered
	}
	fmt.Printf("      ordered %t, instances %d: %s, %d violations recorded, %d redelivered\n", ordered, instances, took.Round(time.Millisecond), violations, redelivered)
	if ordered {
		diffs, err := fulfilment.Compare(ctx, b.pool, 5)
		if err != nil {
			return 0, err
		}
		if len(diffs) > 0 {
			return 0, fmt.Errorf("the ordered run differs from the orders' history:\n%s", strings.Join(diffs, "\n"))
		}
	}
	return float64(done) / took.Seconds(), nil
}
