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
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var (
	orders   = flag.Int("orders", 1_000_000, "orders without an invoice when the backfill starts")
	rate     = flag.Int("rate", 500, "orders the live writers create per second")
	quietFor = flag.Duration("quiet", 15*time.Second, "how long the live freshness is measured before the backfill")
	chunk    = flag.Int("chunk", backfill.DefaultChunk, "the backfill's rows per chunk (fanout backfill --chunk)")
	workers  = flag.Int("workers", backfill.DefaultWorkers, "the backfill's workers (fanout backfill --workers)")
	bfRate   = flag.Float64("backfill-rate", 0, "the backfill's rows per second (fanout backfill --rate; 0: no limit)")
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
	cfg      *benchkit.Config
	db       *pgtest.DB
	nc       *nats.Conn
	js       jetstream.JetStream
	pool     *pgxpool.Pool
	products []int64
}

func run(ctx context.Context) error {
	if err := benchkit.CheckRuns(); err != nil {
		return err
	}
	cfg := benchkit.DefaultConfig()
	suffix := strconv.FormatUint(rand.Uint64()%1_000_000_000, 36)
	cfg.Stream.Name = "BENCHBF_" + suffix
	cfg.Stream.SubjectPrefix = "benchbf" + suffix
	cfg.Subscribers.DeadLetterStream = "BENCHBF_DLQ_" + suffix
	cfg.Subscribers.DeadLetterSubjectPrefix = "benchbfdlq" + suffix
	cfg.Subscribers.Start = "new"
	b := &bench{cfg: cfg}
	var err error
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
	pc.MaxConns = 24
	if b.pool, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
		return err
	}
	defer b.pool.Close()

	fmt.Printf("backfill benchmark, %s, GOMAXPROCS=%d: invoicing's backfill of %d orders (chunks of %d, %d workers) beside %d new orders/s handled live\n\n",
		time.Now().Format(time.RFC3339), runtime.GOMAXPROCS(0), *orders, *chunk, *workers, *rate)
	start := time.Now()
	if err := b.fill(ctx); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	fmt.Printf("setup: %d orders of 2 lines, none invoiced, no events (%.1fs)\n\n", *orders, time.Since(start).Seconds())

	var rows, quietP50, quietP99, busyP50, busyP99, ratio benchkit.Figure
	for round := range *benchkit.Runs {
		res, err := b.runOnce(ctx, round)
		if err != nil {
			return fmt.Errorf("run %d: %w", round+1, err)
		}
		rows.Add(res.rowsPerSec)
		quietP50.Add(ms(res.quiet.p50))
		quietP99.Add(ms(res.quiet.p99))
		busyP50.Add(ms(res.busy.p50))
		busyP99.Add(ms(res.busy.p99))
		ratio.Add(float64(res.busy.p99) / float64(res.quiet.p99))
		fmt.Printf("    run %d of %d: backfill %d rows in %.1fs, %.0f rows/s; freshness p50/p99 %s/%s quiet (%d orders), %s/%s during the backfill (%d orders)\n",
			round+1, *benchkit.Runs, res.rows, res.took.Seconds(), res.rowsPerSec,
			res.quiet.p50.Round(time.Millisecond), res.quiet.p99.Round(time.Millisecond), res.quiet.n,
			res.busy.p50.Round(time.Millisecond), res.busy.p99.Round(time.Millisecond), res.busy.n)
	}
	fmt.Println()
	fmt.Printf("%-58s %s (target >= 20000)\n", "backfill, invoicing (effect in Postgres)", rows.Format("%.0f rows/s"))
	fmt.Printf("%-58s p50 %s, p99 %s\n", fmt.Sprintf("live freshness at %d orders/s, no backfill", *rate), quietP50.Format("%.0f ms"), quietP99.Format("%.0f ms"))
	fmt.Printf("%-58s p50 %s, p99 %s\n", "live freshness during the backfill", busyP50.Format("%.0f ms"), busyP99.Format("%.0f ms"))
	fmt.Printf("    p99 during / p99 quiet = %s (target <= 2x)\n", ratio.Format("%.2fx"))
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// fill seeds a catalog and the orders, without events.
func (b *bench) fill(ctx context.Context) error {
	if _, err := shop.Seed(ctx, b.pool, 1000, rand.New(rand.NewPCG(1, 1))); err != nil {
		return err
	}
	if _, err := b.pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
		return err
	}
	for done := 0; done < *orders; done += 100_000 {
		_, err := b.pool.Exec(ctx, `
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
	rows, err := b.pool.Query(ctx, `SELECT id FROM products ORDER BY id`)
	if err != nil {
		return err
	}
	if b.products, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		return err
	}
	return benchkit.Settle(ctx, b.pool)
}

type latencies struct {
	p50, p99 time.Duration
	n        int
}

func percentiles(ls []time.Duration) latencies {
	if len(ls) == 0 {
		return latencies{}
	}
	slices.Sort(ls)
	return latencies{p50: ls[len(ls)/2], p99: ls[len(ls)*99/100], n: len(ls)}
}

type result struct {
	rows        int64
	took        time.Duration
	rowsPerSec  float64
	quiet, busy latencies
}

// runOnce resets the invoices, runs the live pipeline with its writers for
// -quiet, then the backfill beside it, and checks the invoices.
func (b *bench) runOnce(ctx context.Context, round int) (result, error) {
	var res result
	if err := b.js.DeleteConsumer(ctx, b.cfg.Stream.Name, invoicing.Name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return res, err
	}
	// Settled before the truncate, not after (see bench/subscribers: an
	// empty table analyzed as empty makes every foreign-key check of
	// invoice_lines scan invoices).
	if err := benchkit.Settle(ctx, b.pool); err != nil {
		return res, err
	}
	if _, err := b.pool.Exec(ctx, `TRUNCATE invoice_lines, invoices, processed_events, subscriber_backfill_segments, subscriber_backfills, subscriber_backfill_failures`); err != nil {
		return res, err
	}
	r, err := relay.New(relay.Options{Relay: b.cfg.Relay, Stream: b.cfg.Stream, Pool: b.pool, Conn: b.nc, Logger: benchkit.Quiet})
	if err != nil {
		return res, err
	}
	if err := r.Start(ctx); err != nil {
		return res, err
	}
	defer r.Stop(ctx) //nolint:errcheck
	sub, err := subscribers.New(subscribers.Options{Declaration: invoicing.Subscriber, Handler: subscribers.Tx(invoicing.New()), Config: b.cfg.Subscribers,
		Stream: b.cfg.Stream, Pool: b.pool, Conn: b.nc, Logger: benchkit.Quiet})
	if err != nil {
		return res, err
	}
	if err := sub.Start(ctx); err != nil {
		return res, err
	}
	defer sub.Stop(ctx) //nolint:errcheck

	live := newLiveOrders(b, round)
	liveCtx, stopLive := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { live.write(liveCtx) })
	wg.Go(func() { live.watch(liveCtx) })

	time.Sleep(*quietFor)
	res.quiet = percentiles(live.take())

	start := time.Now()
	s, err := backfill.Run(ctx, backfill.Options{Declaration: invoicing.Subscriber,
		Handler: subscribers.Tx(invoicing.New()), Config: b.cfg.Subscribers, Pool: b.pool, Logger: benchkit.Quiet, Chunk: *chunk, Rate: *bfRate, Workers: *workers})
	res.took = time.Since(start)
	res.busy = percentiles(live.take())
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
	for deadline := time.Now().Add(2 * time.Minute); ; {
		unsent, err := outboxstore.New(b.pool).Unsent(ctx, nil)
		if err != nil {
			return res, err
		}
		if unsent == 0 {
			break
		}
		if time.Now().After(deadline) {
			return res, fmt.Errorf("%d outbox rows unsent 2 minutes after the writers stopped", unsent)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := benchkit.WaitDrained(ctx, b.js, b.cfg.Stream.Name, invoicing.Name, 2*time.Minute); err != nil {
		return res, err
	}
	var uninvoiced, twice int
	if err := b.pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE n = 0), count(*) FILTER (WHERE n > 1)
FROM (SELECT count(i.id) AS n FROM orders o LEFT JOIN invoices i ON i.order_id = o.id GROUP BY o.id) per_order`).Scan(&uninvoiced, &twice); err != nil {
		return res, err
	}
	if uninvoiced != 0 || twice != 0 {
		var lo, hi int64
		_ = b.pool.QueryRow(ctx, `SELECT min(o.id), max(o.id) FROM orders o WHERE NOT EXISTS (SELECT FROM invoices i WHERE i.order_id = o.id)`).Scan(&lo, &hi)
		return res, fmt.Errorf("%d orders without an invoice (ids %d to %d; the backfill went to %d), %d with more than one", uninvoiced, lo, hi, s.HighKey, twice)
	}
	return res, nil
}

// liveOrders writes orders at -rate and measures, for each, the time from
// its commit to its invoice being visible.
type liveOrders struct {
	b       *bench
	rng     *rand.Rand
	mu      sync.Mutex
	pending map[int64]time.Time // order id -> commit time
	lat     []time.Duration
}

func newLiveOrders(b *bench, round int) *liveOrders {
	return &liveOrders{b: b, rng: rand.New(rand.NewPCG(uint64(round), 9)), pending: map[int64]time.Time{}}
}

func (l *liveOrders) write(ctx context.Context) {
	const writers = 4
	interval := time.Second * writers / time.Duration(*rate)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 13))
			next := time.Now()
			for ctx.Err() == nil {
				time.Sleep(time.Until(next))
				next = next.Add(interval)
				product := l.b.products[rng.IntN(len(l.b.products))]
				var id int64
				err := pgx.BeginFunc(ctx, l.b.pool, func(tx pgx.Tx) error {
					var err error
					id, _, err = shop.CreateOrder(ctx, tx, "live", []shop.OrderLine{{ProductID: product, Quantity: 1}})
					return err
				})
				if err == nil {
					l.mu.Lock()
					l.pending[id] = time.Now()
					l.mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
}

// watch polls for the pending orders' invoices every 20 ms.
func (l *liveOrders) watch(ctx context.Context) {
	for ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
		l.mu.Lock()
		ids := make([]int64, 0, len(l.pending))
		for id := range l.pending {
			ids = append(ids, id)
		}
		l.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		// Planned at each poll (not a prepared statement's plan, made
		// while invoices was empty: a scan of the whole table at every
		// poll once the backfill filled it).
		rows, err := l.b.pool.Query(ctx, `SELECT order_id FROM invoices WHERE order_id = ANY($1)`, pgx.QueryExecModeExec, ids)
		if err != nil {
			continue
		}
		seen, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			continue
		}
		now := time.Now()
		l.mu.Lock()
		for _, id := range seen {
			if c, ok := l.pending[id]; ok {
				l.lat = append(l.lat, now.Sub(c))
				delete(l.pending, id)
			}
		}
		l.mu.Unlock()
	}
}

// take returns the latencies measured since the last take.
func (l *liveOrders) take() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	lat := l.lat
	l.lat = nil
	return lat
}
