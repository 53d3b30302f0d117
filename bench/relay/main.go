// Command relay is the relay benchmark (`go tool task bench:relay`). In one
// run, on the local services, it prints:
//
//	(a) fanout's relay draining 200k pending rows, rows/s
//	(b) the naive publisher (poll every 2 s, batch 50, one synchronous publish
//	    after another, then mark) for a fixed 20 s, rows/s
//	(c) raw JetStream async publish of 200k messages with msg ids, no Postgres
//	writer cost: price-update tx/s at 8 connections without and with the
//	    outbox insert and its wake-up (and with a NOTIFY in every transaction)
//	latency: commit → PubAck p50/p99 at a steady 1,000 writes/s
//	held horizon: the same rate while a transaction holds a snapshot for
//	    2 minutes: published/s, p99, claim time, outbox dead tuples (poll)
//	    and slot lag (wal) before, during and after, and over time
//	retention: removing one range of a million captured rows, row by row
//	    (and the vacuum after) against dropping the range: time and WAL
//
// Each part uses a fresh database and a fresh stream; nothing is shared with
// the demo's data. Each figure is measured -runs times (default 3), each
// run after the database is settled (benchkit.Settle), and printed as the
// median and the range of the runs.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/testenv/pgtest"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var (
	rows        = flag.Int("rows", 200_000, "rows for the drain and raw publish runs")
	naiveFor    = flag.Duration("naive", 10*time.Second, "how long the naive publisher runs")
	writerFor   = flag.Duration("writer", 10*time.Second, "how long each writer-cost run lasts")
	latencyFor  = flag.Duration("latency", 15*time.Second, "how long each latency run lasts")
	latencyRate = flag.Int("rate", 1000, "writes/s of the latency and held-horizon runs")
	horizonFor  = flag.Duration("horizon", 2*time.Minute, "how long the held-horizon run holds its snapshot")
	captureOnly = flag.String("capture", "", "run the held-horizon part in this capture mode only: poll or wal")
	natsURL     = flag.String("nats", connect.DefaultNATSURL, "nats-server URL")
	batchSize   = flag.Int("batch", 0, "override relay.batch_size")
	maxInFlight = flag.Int("inflight", 0, "override relay.max_in_flight")
	only        = flag.String("only", "", "run only this part: a, w, b, c, writer, latency, horizon, retention")
	cpuProfile  = flag.String("cpuprofile", "", "write a CPU profile of this process")
	adminURL    = flag.String("postgres", pgtest.AdminURL(), "superuser URL to create benchmark databases")
)

func main() {
	flag.Parse()
	ctx := context.Background()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		_ = pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	if err := run(ctx); err != nil {
		pprof.StopCPUProfile()
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	if err := benchkit.CheckRuns(); err != nil {
		return err
	}
	nc, err := nats.Connect(*natsURL, nats.ReconnectBufSize(-1))
	if err != nil {
		return fmt.Errorf("connect to nats (start the services: go tool task services): %w", err)
	}
	defer nc.Close()
	fmt.Printf("relay benchmark, %s, GOMAXPROCS=%d\n\n", time.Now().Format(time.RFC3339), runtime.GOMAXPROCS(0))

	want := func(part string) bool { return *only == "" || *only == part }
	var a, w, b, c, claimMs, ac, wa, ab benchkit.Figure
	for run := range *benchkit.Runs {
		var ra, rw, rb, rc result
		if want("a") {
			if ra, err = benchDrain(ctx, nc); err != nil {
				return fmt.Errorf("(a): %w", err)
			}
			a.Add(ra.rate)
			claimMs.Add(ra.claimMs)
		}
		if want("w") {
			if rw, err = benchDrainWAL(ctx, nc); err != nil {
				return fmt.Errorf("(w): %w", err)
			}
			w.Add(rw.rate)
		}
		if want("b") {
			if rb, err = benchNaive(ctx, nc); err != nil {
				return fmt.Errorf("(b): %w", err)
			}
			b.Add(rb.rate)
		}
		if want("c") {
			if rc, err = benchRaw(ctx, nc); err != nil {
				return fmt.Errorf("(c): %w", err)
			}
			c.Add(rc.rate)
		}
		if *only == "" {
			// Ratios within one run: the parts ran minutes apart at most.
			ac.Add(ra.rate / rc.rate)
			wa.Add(rw.rate / ra.rate)
			ab.Add(ra.rate / rb.rate)
		}
		if want("a") || want("w") || want("b") || want("c") {
			fmt.Printf("    run %d of %d: a %.0f rows/s  w %.0f rows/s  b %.1f rows/s  c %.0f msgs/s\n", run+1, *benchkit.Runs, ra.rate, rw.rate, rb.rate, rc.rate)
		}
	}
	if want("a") {
		fmt.Printf("(a) fanout relay (relay.capture poll) draining %d rows: %s; a claim took %s on average\n", *rows, a.Format("%.0f rows/s"), claimMs.Format("%.1fms"))
	}
	if want("w") {
		fmt.Printf("(w) fanout relay (relay.capture wal) draining %d rows from its slot (committed in transactions of 1000 while it was stopped): %s\n", *rows, w.Format("%.0f rows/s"))
	}
	if want("b") {
		fmt.Printf("(b) naive publisher (poll 2s, batch 50, sync publish, then mark) for %s: %s\n", *naiveFor, b.Format("%.1f rows/s"))
	}
	if want("c") {
		fmt.Printf("(c) raw JetStream async publish, %d msgs with msg ids: %s\n", *rows, c.Format("%.0f msgs/s"))
	}
	if *only == "" {
		fmt.Printf("    a/c = %s (target >= 0.35)   a/b = %s (target >= 1000)   w/a = %s (target for wal: >= 1)\n\n", ac.Format("%.2f"), ab.Format("%.0f"), wa.Format("%.2f"))
	}
	if want("writer") {
		if err := benchWriterCost(ctx, nc); err != nil {
			return fmt.Errorf("writer cost: %w", err)
		}
	}
	if want("latency") {
		if err := benchLatency(ctx, nc); err != nil {
			return fmt.Errorf("latency: %w", err)
		}
	}
	if want("horizon") {
		if err := benchHorizon(ctx, nc); err != nil {
			return fmt.Errorf("held horizon: %w", err)
		}
	}
	if want("retention") {
		if err := benchRetention(ctx); err != nil {
			return fmt.Errorf("retention: %w", err)
		}
	}
	return nil
}

type result struct {
	n       int
	secs    float64
	rate    float64
	claimMs float64 // the drain's mean claim time
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// freshStream returns a stream config with a name and subject prefix of its
// own, and deletes the stream when done is called.
func freshStream(nc *nats.Conn) (stream.Config, func(), error) {
	s := stream.DefaultConfig()
	suffix := strconv.FormatUint(rand.Uint64()%1_000_000_000, 36)
	s.Name = "BENCH_" + suffix
	s.SubjectPrefix = "bench" + suffix
	done := func() {
		js, err := jetstream.New(nc)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = js.DeleteStream(ctx, s.Name)
		}
	}
	return s, done, nil
}

func relayConfig() relay.Config {
	cfg := relay.DefaultConfig()
	if *batchSize > 0 {
		cfg.BatchSize = *batchSize
	}
	if *maxInFlight > 0 {
		cfg.MaxInFlight = *maxInFlight
	}
	return cfg
}

// fillOutbox inserts n pending product.updated rows with payloads like the
// demo's, over 1000 products, a statement (and a transaction) per 1000
// rows: one transaction numbering many events of one aggregate costs
// quadratically (README, "Per-aggregate order"), and in one statement the
// 200,000 rows of a drain took 9 s to write instead of under 1 s.
func fillOutbox(ctx context.Context, pool *pgxpool.Pool, n int) error {
	const chunk = 1000
	for from := 1; from <= n; from += chunk {
		if _, err := pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'product', (g % 1000 + 1)::text, 'product.updated',
       jsonb_build_object('product_id', g % 1000 + 1, 'version', g, 'price_cents', 1000 + g % 90000)
FROM generate_series($1::bigint, $2::bigint) AS g`, from, min(from+chunk-1, n)); err != nil {
			return err
		}
	}
	return nil
}

// counter counts published rows and can wait for a total.
type counter struct {
	relay.NopObserver
	n          atomic.Int64
	claims     atomic.Int64
	claimNanos atomic.Int64
}

func (c *counter) Claimed(n int, took time.Duration) { c.claims.Add(1); c.claimNanos.Add(int64(took)) }

func (c *counter) Published(ev []relay.Published) { c.n.Add(int64(len(ev))) }

func benchDrain(ctx context.Context, nc *nats.Conn) (result, error) {
	env, err := newRelayEnv(ctx, nc)
	if err != nil {
		return result{}, err
	}
	defer env.close()
	if err := fillOutbox(ctx, env.db.Pool, *rows); err != nil {
		return result{}, err
	}
	if err := benchkit.Settle(ctx, env.db.Pool); err != nil {
		return result{}, err
	}
	res, obs, err := timeDrain(ctx, relay.Options{Relay: relayConfig(), Stream: env.stream, Pool: env.relayPool, Conn: nc, Logger: quiet})
	if err != nil {
		return result{}, err
	}
	res.claimMs = float64(obs.claimNanos.Load()) / float64(obs.claims.Load()) / 1e6
	return res, nil
}

// timeDrain starts a relay with opts and times it until it published
// -rows rows.
func timeDrain(ctx context.Context, opts relay.Options) (result, *counter, error) {
	obs := &counter{}
	opts.Observer = obs
	r, err := relay.New(opts)
	if err != nil {
		return result{}, nil, err
	}
	start := time.Now()
	if err := r.Start(ctx); err != nil {
		return result{}, nil, err
	}
	for obs.n.Load() < int64(*rows) {
		time.Sleep(5 * time.Millisecond)
	}
	secs := time.Since(start).Seconds()
	_ = r.Stop(ctx)
	return result{n: *rows, secs: secs, rate: float64(*rows) / secs}, obs, nil
}

// benchDrainWAL measures a wal relay draining its slot: a relay creates
// the slot and stops, rows are committed in transactions of 1000, and a new
// relay publishes them from the slot.
func benchDrainWAL(ctx context.Context, nc *nats.Conn) (result, error) {
	env, err := newRelayEnv(ctx, nc)
	if err != nil {
		return result{}, err
	}
	defer env.close()
	db, sc, rp := env.db, env.stream, env.relayPool
	rc := relayConfig()
	rc.Capture, rc.Slot = relay.CaptureWAL, db.Name
	first, err := relay.New(relay.Options{Relay: rc, Stream: sc, Pool: rp, Conn: nc, Logger: quiet})
	if err != nil {
		return result{}, err
	}
	if err := first.Start(ctx); err != nil {
		return result{}, err
	}
	if err := waitFor(ctx, 30*time.Second, func() (bool, error) {
		var done bool
		err := db.Pool.QueryRow(ctx, `SELECT backlog_done_at IS NOT NULL FROM relay_capture WHERE slot_name = $1`, rc.Slot).Scan(&done)
		if errors.Is(err, pgx.ErrNoRows) {
			return false, nil
		}
		return done, err
	}); err != nil {
		return result{}, fmt.Errorf("the slot: %w", err)
	}
	if err := first.Stop(ctx); err != nil {
		return result{}, err
	}
	for filled := 0; filled < *rows; filled += 1000 {
		if err := fillOutbox(ctx, db.Pool, min(1000, *rows-filled)); err != nil {
			return result{}, err
		}
	}
	if err := benchkit.Settle(ctx, db.Pool); err != nil {
		return result{}, err
	}
	res, _, err := timeDrain(ctx, relay.Options{Relay: rc, Stream: sc, Pool: rp, Conn: nc, Logger: quiet})
	return res, err
}

// waitFor polls cond every 10ms for up to timeout.
func waitFor(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil || ok {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// benchNaive runs the seeds' publisher: every 2 s it reads up to 50 pending
// rows, publishes them one after another waiting for each PubAck, then marks
// them sent.
func benchNaive(ctx context.Context, nc *nats.Conn) (result, error) {
	db, err := pgtest.Create(ctx, *adminURL)
	if err != nil {
		return result{}, err
	}
	defer db.Close()
	sc, done, err := freshStream(nc)
	if err != nil {
		return result{}, err
	}
	defer done()
	js, err := jetstream.New(nc)
	if err != nil {
		return result{}, err
	}
	if err := stream.Ensure(ctx, js, sc, 0, quiet); err != nil {
		return result{}, err
	}
	if err := fillOutbox(ctx, db.Pool, 10_000); err != nil {
		return result{}, err
	}
	if err := benchkit.Settle(ctx, db.Pool); err != nil {
		return result{}, err
	}
	runCtx, cancel := context.WithTimeout(ctx, *naiveFor)
	defer cancel()
	published := 0
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for runCtx.Err() == nil {
		rs, err := db.Pool.Query(runCtx, `SELECT id, event_type, payload FROM outbox WHERE status = 'pending' ORDER BY id LIMIT 50`)
		if err != nil {
			break
		}
		type naiveRow struct {
			id      int64
			typ     string
			payload []byte
		}
		batch, err := pgx.CollectRows(rs, func(r pgx.CollectableRow) (naiveRow, error) {
			var n naiveRow
			return n, r.Scan(&n.id, &n.typ, &n.payload)
		})
		if err != nil {
			break
		}
		var ids []int64
		for _, r := range batch {
			if _, err := js.Publish(runCtx, sc.SubjectPrefix+"."+r.typ, r.payload, jetstream.WithMsgID(strconv.FormatInt(r.id, 10))); err != nil {
				break
			}
			ids = append(ids, r.id)
		}
		if _, err := db.Pool.Exec(runCtx, `UPDATE outbox SET status = 'sent', published_at = now() WHERE id = ANY($1)`, ids); err != nil {
			break
		}
		published += len(ids)
		select {
		case <-runCtx.Done():
		case <-tick.C:
		}
	}
	return result{n: published, secs: naiveFor.Seconds(), rate: float64(published) / naiveFor.Seconds()}, nil
}

func benchRaw(ctx context.Context, nc *nats.Conn) (result, error) {
	sc, done, err := freshStream(nc)
	if err != nil {
		return result{}, err
	}
	defer done()
	rc := relayConfig()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(rc.MaxInFlight))
	if err != nil {
		return result{}, err
	}
	if err := stream.Ensure(ctx, js, sc, 0, quiet); err != nil {
		return result{}, err
	}
	payloads := make([][]byte, 1000)
	for i := range payloads {
		payloads[i] = fmt.Appendf(nil, `{"version": %d, "product_id": %d, "price_cents": %d}`, i, i+1, 1000+i)
	}
	subject := sc.SubjectPrefix + ".product.updated"
	var failed atomic.Int64
	start := time.Now()
	futures := make([]jetstream.PubAckFuture, 0, *rows)
	for i := range *rows {
		msg := nats.NewMsg(subject)
		msg.Data = payloads[i%len(payloads)]
		msg.Header.Set(outbox.EventIDHeader, strconv.Itoa(i+1))
		f, err := js.PublishMsgAsync(msg, jetstream.WithMsgID(strconv.Itoa(i+1)))
		if err != nil {
			return result{}, err
		}
		futures = append(futures, f)
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(2 * time.Minute):
		return result{}, fmt.Errorf("raw publish did not complete")
	}
	secs := time.Since(start).Seconds()
	for _, f := range futures {
		select {
		case <-f.Err():
			failed.Add(1)
		default:
		}
	}
	if failed.Load() > 0 {
		return result{}, fmt.Errorf("%d raw publishes failed", failed.Load())
	}
	return result{n: *rows, secs: secs, rate: float64(*rows) / secs}, nil
}

// benchWriterCost measures price-update transactions per second at 8
// connections, with and without the outbox.
func benchWriterCost(ctx context.Context, nc *nats.Conn) error {
	db, err := pgtest.Create(ctx, *adminURL)
	if err != nil {
		return err
	}
	defer db.Close()
	pool, err := poolWithConns(ctx, db.URL, 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := shop.Seed(ctx, pool, 1000, rand.New(rand.NewPCG(1, 2))); err != nil {
		return err
	}
	var maxID int64
	if err := pool.QueryRow(ctx, `SELECT max(id) FROM products`).Scan(&maxID); err != nil {
		return err
	}
	const update = `UPDATE products SET price = $2::numeric / 100, version = version + 1, updated_at = now() WHERE id = $1`
	plain := func(ctx context.Context, tx pgx.Tx, id, price int64) error {
		_, err := tx.Exec(ctx, update, id, price)
		return err
	}
	event := func(id, price int64) outbox.Event {
		return outbox.Event{AggregateType: "product", AggregateID: strconv.FormatInt(id, 10), Type: shop.ProductUpdated,
			Payload: shop.ProductEvent{ProductID: id, PriceCents: &price}}
	}
	ownRoundTrip := func(w *outbox.Writer) func(context.Context, pgx.Tx, int64, int64) error {
		return func(ctx context.Context, tx pgx.Tx, id, price int64) error {
			if _, err := tx.Exec(ctx, update, id, price); err != nil {
				return err
			}
			_, err := w.Write(ctx, tx, event(id, price))
			return err
		}
	}
	pipelined := func(w *outbox.Writer) func(context.Context, pgx.Tx, int64, int64) error {
		return func(ctx context.Context, tx pgx.Tx, id, price int64) error {
			b := &pgx.Batch{}
			b.Queue(update, id, price)
			if err := w.Queue(b, event(id, price), nil); err != nil {
				return err
			}
			return tx.SendBatch(ctx, b).Close()
		}
	}
	demo := func(ctx context.Context, tx pgx.Tx, id, price int64) error {
		_, err := shop.UpdatePrice(ctx, tx, id, price)
		return err
	}
	runs := []struct {
		name    string
		fn      func(context.Context, pgx.Tx, int64, int64) error
		capture string // a relay of this capture runs during the measurement
	}{
		{"price update alone", plain, ""},
		{"+ outbox.Write in its own round trip, no wake-up", ownRoundTrip(outbox.NewWriter(-1)), ""},
		{"+ outbox.Queue pipelined with the update, NOTIFY in every tx", pipelined(outbox.NewWriter(0)), ""},
		{"+ outbox.Queue pipelined, no wake-up", pipelined(outbox.NewWriter(-1)), ""},
		{"shop.UpdatePrice: outbox.Queue + fanout wake-up (NOTIFY at most every " + outbox.DefaultWakeInterval.String() + ")", demo, ""},
		{"shop.UpdatePrice, with a relay (capture poll) publishing", demo, relay.CapturePoll},
		{"outbox.Queue pipelined, no wake-up, with a relay (capture wal) publishing", pipelined(outbox.NewWriter(-1)), relay.CaptureWAL},
	}
	// withRelay runs fn while a relay of the capture publishes what the
	// writers commit, to a stream of its own.
	withRelay := func(capture string, fn func() error) error {
		if capture == "" {
			return fn()
		}
		sc, done, err := freshStream(nc)
		if err != nil {
			return err
		}
		defer done()
		rp, err := relayPool(ctx, db.URL)
		if err != nil {
			return err
		}
		defer rp.Close()
		rc := relayConfig()
		rc.Capture, rc.Slot = capture, db.Name
		r, err := relay.New(relay.Options{Relay: rc, Stream: sc, Pool: rp, Conn: nc, Logger: quiet})
		if err != nil {
			return err
		}
		if err := r.Start(ctx); err != nil {
			return err
		}
		time.Sleep(2 * time.Second) // the backlog of earlier variants, and the slot
		ferr := fn()
		if err := r.Stop(ctx); err != nil && ferr == nil {
			ferr = err
		}
		if capture == relay.CaptureWAL {
			// Drop the slot, or it keeps WAL for the variants after it.
			// The walsender may outlive the relay's stream by a moment.
			if err := dropSlot(ctx, db.Pool, db.Name); err != nil && ferr == nil {
				ferr = err
			}
		}
		return ferr
	}
	fmt.Printf("writer cost: price-update transactions/s at 8 connections, %s each, %d rounds (the variants in a new order each round)\n", *writerFor, *benchkit.Runs)
	tps := make([]benchkit.Figure, len(runs))
	ratio := make([]benchkit.Figure, len(runs)) // of alone, within the round
	for round := range *benchkit.Runs {
		if err := benchkit.Settle(ctx, pool); err != nil {
			return err
		}
		got := make([]float64, len(runs))
		for k := range runs {
			i := (k + round) % len(runs) // no variant always runs first, or last
			err := withRelay(runs[i].capture, func() error {
				var err error
				got[i], err = measureTPS(ctx, pool, maxID, runs[i].fn)
				return err
			})
			if err != nil {
				return fmt.Errorf("%s: %w", runs[i].name, err)
			}
		}
		for i := range runs {
			tps[i].Add(got[i])
			ratio[i].Add(100 * got[i] / got[0])
		}
	}
	for i, r := range runs {
		if i == 0 {
			fmt.Printf("    %-80s %s\n", r.name, tps[i].Format("%.0f tx/s"))
			continue
		}
		fmt.Printf("    %-80s %s, %s of alone\n", r.name, tps[i].Format("%.0f tx/s"), ratio[i].Format("%.0f%%"))
	}
	fmt.Println("    target: the outbox and its wake-up cost writers <= 25% of their tx/s; with a wal relay publishing, <= 10%")
	fmt.Println()
	return nil
}

// relayPool is the pool `fanout relay` opens with the default
// configuration: postgres.max_conns connections, synchronous_commit off
// (connect.AsyncCommit).
func relayPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	cfg := connect.DefaultPostgres()
	cfg.URL = url
	return connect.Postgres(ctx, cfg, "relay", connect.AsyncCommit())
}

func poolWithConns(ctx context.Context, url string, n int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pc.MaxConns, pc.MinConns = n, n
	return pgxpool.NewWithConfig(ctx, pc)
}

func measureTPS(ctx context.Context, pool *pgxpool.Pool, maxID int64, fn func(context.Context, pgx.Tx, int64, int64) error) (float64, error) {
	runCtx, cancel := context.WithTimeout(ctx, *writerFor)
	defer cancel()
	var n atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	start := time.Now()
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for runCtx.Err() == nil {
				id := 1 + rng.Int64N(maxID)
				err := pgx.BeginFunc(runCtx, pool, func(tx pgx.Tx) error { return fn(runCtx, tx, id, 1000+rng.Int64N(90000)) })
				if err != nil {
					if runCtx.Err() == nil {
						once.Do(func() { firstErr = err })
					}
					continue
				}
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	return float64(n.Load()) / time.Since(start).Seconds(), firstErr
}

// latencyObserver records each event's PubAck time.
type latencyObserver struct {
	relay.NopObserver
	mu    sync.Mutex
	acked map[int64]time.Time
}

func (o *latencyObserver) Published(ev []relay.Published) {
	o.mu.Lock()
	for _, p := range ev {
		o.acked[p.ID] = p.AckedAt
	}
	o.mu.Unlock()
}

func benchLatency(ctx context.Context, nc *nats.Conn) error {
	fmt.Printf("latency: commit → PubAck at a steady %d writes/s for %s (price updates, 8 connections), %d runs of each\n", *latencyRate, *latencyFor, *benchkit.Runs)
	variants := []struct {
		name string
		mut  func(*relay.Config)
	}{
		{"fanout default (wake-up + eager polling, poll_interval 500ms)", func(*relay.Config) {}},
		{"relay.listen=false (eager polling alone, no wake-up)", func(c *relay.Config) { c.Listen = false }},
		{"relay.capture=wal (decoded from the replication slot)", func(c *relay.Config) { c.Capture = relay.CaptureWAL }},
	}
	p50s := make([]benchkit.Figure, len(variants))
	p99s := make([]benchkit.Figure, len(variants))
	maxs := make([]benchkit.Figure, len(variants))
	for run := range *benchkit.Runs {
		for k := range variants {
			i := (k + run) % len(variants)
			p50, p99, max, _, err := measureLatency(ctx, nc, variants[i].mut)
			if err != nil {
				return fmt.Errorf("%s: %w", variants[i].name, err)
			}
			p50s[i].Add(ms(p50))
			p99s[i].Add(ms(p99))
			maxs[i].Add(ms(max))
		}
	}
	for i, v := range variants {
		fmt.Printf("    %s\n        p50 %s  p99 %s  max %s\n", v.name, p50s[i].Format("%.2fms"), p99s[i].Format("%.2fms"), maxs[i].Format("%.2fms"))
	}
	fmt.Println("    target: p99 <= 10ms in every run, and the default no worse than polling alone (medians)")
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func measureLatency(ctx context.Context, nc *nats.Conn, mutate func(*relay.Config)) (p50, p99, max time.Duration, n int, err error) {
	obs := &latencyObserver{acked: map[int64]time.Time{}}
	env, err := startSteadyEnv(ctx, nc, mutate, obs)
	if err != nil {
		return
	}
	defer env.close()

	var mu sync.Mutex
	committed := map[int64]time.Time{}
	runCtx, cancel := context.WithTimeout(ctx, *latencyFor)
	defer cancel()
	env.writeSteadily(runCtx, func(eventID int64, at time.Time) {
		mu.Lock()
		committed[eventID] = at
		mu.Unlock()
	})
	time.Sleep(time.Second) // the last PubAcks
	var lat []time.Duration
	obs.mu.Lock()
	for id, c := range committed {
		if a, ok := obs.acked[id]; ok {
			lat = append(lat, max0(a.Sub(c)))
		}
	}
	obs.mu.Unlock()
	if len(lat) < len(committed) {
		return 0, 0, 0, 0, fmt.Errorf("%d of %d committed events not published within a second of the end", len(committed)-len(lat), len(committed))
	}
	slices.Sort(lat)
	return lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1], len(lat), nil
}

// dropSlot drops a replication slot, waiting up to 10 s for the walsender
// of a stream that just closed to let go of it.
func dropSlot(ctx context.Context, pool *pgxpool.Pool, slot string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" || time.Now().After(deadline) { // object_in_use
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// relayEnv is what a relay's run starts from: a fresh database, a stream
// of its own, and the relay's pool on the database.
type relayEnv struct {
	db        *pgtest.DB
	stream    stream.Config
	relayPool *pgxpool.Pool
	cleanup   []func() // in the order to undo
}

func newRelayEnv(ctx context.Context, nc *nats.Conn) (_ *relayEnv, err error) {
	e := &relayEnv{}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	if e.db, err = pgtest.Create(ctx, *adminURL); err != nil {
		return nil, err
	}
	e.cleanup = append(e.cleanup, e.db.Close)
	// The outbox's ranges as a running installation has them, ahead of
	// the ids: without them, a fresh database's first rows go to
	// outbox_default (the margin), and the run would measure that.
	if _, err = outbox.NewStore(e.db.Pool).ExtendPartitions(ctx, relay.DefaultPartitionSize, 2, 1); err != nil {
		return nil, fmt.Errorf("add the outbox's first ranges: %w", err)
	}
	stream, done, err := freshStream(nc)
	if err != nil {
		return nil, err
	}
	e.stream = stream
	e.cleanup = append(e.cleanup, done)
	if e.relayPool, err = relayPool(ctx, e.db.URL); err != nil {
		return nil, err
	}
	e.cleanup = append(e.cleanup, e.relayPool.Close)
	return e, nil
}

func (e *relayEnv) close() {
	for _, f := range slices.Backward(e.cleanup) {
		f()
	}
}

// steadyEnv is a relayEnv with the shop seeded and settled and a relay
// running, for runs under a steady write rate.
type steadyEnv struct {
	*relayEnv
	pool  *pgxpool.Pool // the writers' 8 connections
	maxID int64         // of products
}

func startSteadyEnv(ctx context.Context, nc *nats.Conn, mutate func(*relay.Config), obs relay.Observer) (_ *steadyEnv, err error) {
	env, err := newRelayEnv(ctx, nc)
	if err != nil {
		return nil, err
	}
	e := &steadyEnv{relayEnv: env}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	if e.pool, err = poolWithConns(ctx, e.db.URL, 8); err != nil {
		return nil, err
	}
	e.cleanup = append(e.cleanup, e.pool.Close)
	if _, err = shop.Seed(ctx, e.pool, 1000, rand.New(rand.NewPCG(3, 4))); err != nil {
		return nil, err
	}
	if err = benchkit.Settle(ctx, e.pool); err != nil {
		return nil, err
	}
	rc := relayConfig()
	mutate(&rc)
	rc.Slot = e.db.Name // slot names are cluster-wide
	r, err := relay.New(relay.Options{Relay: rc, Stream: e.stream, Pool: e.relayPool, Conn: nc, Logger: quiet, Observer: obs})
	if err != nil {
		return nil, err
	}
	if err = r.Start(ctx); err != nil {
		return nil, err
	}
	e.cleanup = append(e.cleanup, func() { _ = r.Stop(context.Background()) })
	// Let the seed's product.created events drain first.
	time.Sleep(2 * time.Second)
	if err = e.pool.QueryRow(ctx, `SELECT max(id) FROM products`).Scan(&e.maxID); err != nil {
		return nil, err
	}
	return e, nil
}

// writeSteadily commits price updates (each with its outbox event) at
// -rate writes/s over 8 connections until ctx ends, and reports each
// event's id and the moment its commit returned.
func (e *steadyEnv) writeSteadily(ctx context.Context, committed func(eventID int64, at time.Time)) {
	var wg sync.WaitGroup
	const workers = 8
	interval := time.Second * workers / time.Duration(*latencyRate)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 9))
			next := time.Now().Add(time.Duration(w) * interval / workers)
			for ctx.Err() == nil {
				time.Sleep(time.Until(next))
				next = next.Add(interval)
				id := 1 + rng.Int64N(e.maxID)
				price := 1000 + rng.Int64N(90000)
				var eventID int64
				err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					var err error
					eventID, err = shop.UpdatePrice(ctx, tx, id, price)
					return err
				})
				if err == nil {
					committed(eventID, time.Now())
				}
			}
		}()
	}
	wg.Wait()
}

// max0 clamps a negative latency (the PubAck raced ahead of the writer's
// clock read after Commit returned) to zero.
func max0(d time.Duration) time.Duration {
	if d < 0 {
		return 0
	}
	return d
}
