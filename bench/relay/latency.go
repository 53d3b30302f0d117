package main

// Latency: commit → PubAck at a steady write rate, and the environments
// the steady parts (latency, held horizon) run in.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

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

// latencies are the commit → PubAck times of the committed events acked
// so far.
func (o *latencyObserver) latencies(committed map[int64]time.Time) []time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	var lat []time.Duration
	for id, c := range committed {
		if a, ok := o.acked[id]; ok {
			// At least 0: the PubAck may race ahead of the writer's clock
			// read after Commit returned.
			lat = append(lat, max(a.Sub(c), 0))
		}
	}
	return lat
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
		for _, i := range benchkit.Rotation(run, len(variants)) {
			l, err := measureLatency(ctx, nc, variants[i].mut)
			if err != nil {
				return fmt.Errorf("%s: %w", variants[i].name, err)
			}
			p50s[i].Add(benchkit.Ms(l.P50))
			p99s[i].Add(benchkit.Ms(l.P99))
			maxs[i].Add(benchkit.Ms(l.Max))
		}
	}
	for i, v := range variants {
		fmt.Printf("    %s\n        p50 %s  p99 %s  max %s\n", v.name, p50s[i].Format("%.2fms"), p99s[i].Format("%.2fms"), maxs[i].Format("%.2fms"))
	}
	fmt.Println("    target: p99 <= 10ms in every run, and the default no worse than polling alone (medians)")
	return nil
}

func measureLatency(ctx context.Context, nc *nats.Conn, mutate func(*relay.Config)) (benchkit.Latencies, error) {
	obs := &latencyObserver{acked: map[int64]time.Time{}}
	env, err := startSteadyEnv(ctx, nc, mutate, obs)
	if err != nil {
		return benchkit.Latencies{}, err
	}
	defer env.close()

	runCtx, cancel := context.WithTimeout(ctx, *latencyFor)
	defer cancel()
	committed := env.writeSteadily(runCtx)
	time.Sleep(time.Second) // the last PubAcks
	lat := obs.latencies(committed)
	if len(lat) < len(committed) {
		return benchkit.Latencies{}, fmt.Errorf("%d of %d committed events not published within a second of the end", len(committed)-len(lat), len(committed))
	}
	return benchkit.Quantiles(lat), nil
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
	nc        *nats.Conn
	db        *pgtest.DB
	stream    stream.Config
	relayPool *pgxpool.Pool
	cleanup   []func() // in the order to undo
}

// newRelayEnv makes a relayEnv whose relay publishes to sc, or, if sc is
// nil, to a stream of its own (freshStream), deleted by close.
func newRelayEnv(ctx context.Context, nc *nats.Conn, sc *stream.Config) (_ *relayEnv, err error) {
	e := &relayEnv{nc: nc}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	if e.db, err = pgtest.Create(ctx, *benchkit.AdminURL); err != nil {
		return nil, err
	}
	e.cleanup = append(e.cleanup, e.db.Close)
	// The outbox's ranges as a running installation has them, ahead of
	// the ids: without them, a fresh database's first rows go to
	// outbox_default (the margin), and the run would measure that.
	if _, err = outboxstore.New(e.db.Pool).ExtendPartitions(ctx, relay.DefaultPartitionSize, 2, 1); err != nil {
		return nil, fmt.Errorf("add the outbox's first ranges: %w", err)
	}
	if sc != nil {
		e.stream = *sc
	} else {
		var done func()
		e.stream, done = freshStream(nc)
		e.cleanup = append(e.cleanup, done)
	}
	if e.relayPool, err = relayPool(ctx, e.db.URL); err != nil {
		return nil, err
	}
	e.cleanup = append(e.cleanup, e.relayPool.Close)
	return e, nil
}

// options are a relay's, of config rc, on the environment.
func (e *relayEnv) options(rc relay.Config) relay.Options {
	return relay.Options{Relay: rc, Stream: e.stream, Pool: e.relayPool, Conn: e.nc, Logger: quiet, EventTypes: eventTypes()}
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
	env, err := newRelayEnv(ctx, nc, nil)
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
	opts := e.options(rc)
	opts.Observer = obs
	r, err := benchkit.StartRelay(ctx, opts)
	if err != nil {
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
// -rate writes/s over 8 connections until ctx ends, and returns each
// event's id with the moment its commit returned.
func (e *steadyEnv) writeSteadily(ctx context.Context) map[int64]time.Time {
	var mu sync.Mutex
	committed := map[int64]time.Time{}
	benchkit.Pace{Workers: 8, Rate: *latencyRate, Seed: 9, Staggered: true}.Run(ctx, func(_, _ int, rng *rand.Rand) {
		id := 1 + rng.Int64N(e.maxID)
		price := 1000 + rng.Int64N(90000)
		var eventID int64
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			var err error
			eventID, err = shop.UpdatePrice(ctx, tx, id, price)
			return err
		})
		if err == nil {
			at := time.Now()
			mu.Lock()
			committed[eventID] = at
			mu.Unlock()
		}
	})
	return committed
}
