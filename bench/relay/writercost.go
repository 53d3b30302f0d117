package main

// Writer cost: what the outbox insert, its wake-up and a running relay
// take from a writer's transactions per second.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

// writerBench is the writer-cost part's connection and database, the
// shop seeded in it.
type writerBench struct {
	nc    *nats.Conn
	db    *pgtest.DB
	maxID int64 // of products
}

// writerVariant is one way of writing a price update.
type writerVariant struct {
	name    string
	write   func(ctx context.Context, tx pgx.Tx, id, price int64) error
	capture string // a relay of this capture runs during the measurement
}

// benchWriterCost measures price-update transactions per second at 8
// connections, with and without the outbox.
func benchWriterCost(ctx context.Context, nc *nats.Conn) error {
	db, err := pgtest.Create(ctx, *benchkit.AdminURL)
	if err != nil {
		return err
	}
	defer db.Close()
	pool, err := poolWithConns(ctx, db.URL, 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	w := &writerBench{nc: nc, db: db}
	if _, err := shop.Seed(ctx, pool, 1000, rand.New(rand.NewPCG(1, 2))); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, `SELECT max(id) FROM products`).Scan(&w.maxID); err != nil {
		return err
	}
	variants, err := writerVariants(ctx, pool)
	if err != nil {
		return err
	}
	fmt.Printf("writer cost: price-update transactions/s at 8 connections, %s each, %d rounds (the variants in a new order each round)\n", *writerFor, *benchkit.Runs)
	tps := make([]benchkit.Figure, len(variants))
	ratio := make([]benchkit.Figure, len(variants)) // of alone, within the round
	for round := range *benchkit.Runs {
		if err := benchkit.Settle(ctx, pool); err != nil {
			return err
		}
		got := make([]float64, len(variants))
		for _, i := range benchkit.Rotation(round, len(variants)) {
			v := variants[i]
			err := w.withRelay(ctx, v.capture, func() error {
				var err error
				got[i], err = measureTPS(ctx, pool, w.maxID, v.write)
				return err
			})
			if err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
		}
		for i := range variants {
			tps[i].Add(got[i])
			ratio[i].Add(100 * got[i] / got[0])
		}
	}
	for i, v := range variants {
		if i == 0 {
			fmt.Printf("    %-80s %s\n", v.name, tps[i].Format("%.0f tx/s"))
			continue
		}
		fmt.Printf("    %-80s %s, %s of alone\n", v.name, tps[i].Format("%.0f tx/s"), ratio[i].Format("%.0f%%"))
	}
	fmt.Println("    target: the outbox and its wake-up cost writers <= 25% of their tx/s; with a wal relay publishing, <= 10%; the insert alone (pipelined, no wake-up) <= 20%")
	fmt.Println()
	return nil
}

// writerVariants are the ways of writing a price update measured, from
// the update alone to the shop's own with a relay publishing; the first is
// what the others are compared with.
func writerVariants(ctx context.Context, pool *pgxpool.Pool) ([]writerVariant, error) {
	const update = `UPDATE products SET price = $2::numeric / 100, version = version + 1, updated_at = now() WHERE id = $1`
	plain := func(ctx context.Context, tx pgx.Tx, id, price int64) error {
		_, err := tx.Exec(ctx, update, id, price)
		return err
	}
	event := func(typ string, id, price int64) outbox.Event {
		return outbox.Event{AggregateType: "product", AggregateID: strconv.FormatInt(id, 10), Type: typ,
			Payload: shop.ProductEvent{ProductID: id, PriceCents: &price}}
	}
	// The same event under a type the outbox does not number (fanout
	// outbox numbering --skip): what the numbering trigger costs.
	const unnumberedType = "product.repriced"
	if err := outboxstore.New(pool).SetNumbering(ctx, []string{unnumberedType}); err != nil {
		return nil, err
	}
	ownRoundTrip := func(w *outbox.Writer) func(context.Context, pgx.Tx, int64, int64) error {
		return func(ctx context.Context, tx pgx.Tx, id, price int64) error {
			if _, err := tx.Exec(ctx, update, id, price); err != nil {
				return err
			}
			_, err := w.Write(ctx, tx, event(shop.ProductUpdated, id, price))
			return err
		}
	}
	pipelined := func(w *outbox.Writer, typ string) func(context.Context, pgx.Tx, int64, int64) error {
		return func(ctx context.Context, tx pgx.Tx, id, price int64) error {
			b := &pgx.Batch{}
			b.Queue(update, id, price)
			if err := w.Queue(b, event(typ, id, price), nil); err != nil {
				return err
			}
			return tx.SendBatch(ctx, b).Close()
		}
	}
	demo := func(ctx context.Context, tx pgx.Tx, id, price int64) error {
		_, err := shop.UpdatePrice(ctx, tx, id, price)
		return err
	}
	return []writerVariant{
		{"price update alone", plain, ""},
		{"+ outbox.Write in its own round trip, no wake-up", ownRoundTrip(outbox.NewWriter(-1)), ""},
		{"+ outbox.Queue pipelined with the update, NOTIFY in every tx", pipelined(outbox.NewWriter(0), shop.ProductUpdated), ""},
		{"+ outbox.Queue pipelined, no wake-up", pipelined(outbox.NewWriter(-1), shop.ProductUpdated), ""},
		{"+ outbox.Queue pipelined, no wake-up, its event type not numbered", pipelined(outbox.NewWriter(-1), unnumberedType), ""},
		{"+ outbox.Queue pipelined, no wake-up, checked against shop.EventTypes", pipelined(outbox.NewWriter(-1, outbox.CheckedAgainst(shop.EventTypes)), shop.ProductUpdated), ""},
		{"shop.UpdatePrice: outbox.Queue + fanout wake-up (NOTIFY at most every " + outbox.DefaultWakeInterval.String() + ")", demo, ""},
		{"shop.UpdatePrice, with a relay (capture poll) publishing", demo, relay.CapturePoll},
		{"outbox.Queue pipelined, no wake-up, with a relay (capture wal) publishing", pipelined(outbox.NewWriter(-1), shop.ProductUpdated), relay.CaptureWAL},
	}, nil
}

// withRelay runs fn while a relay of the capture (none: "") publishes
// what the writers commit, to a stream of its own.
func (w *writerBench) withRelay(ctx context.Context, capture string, fn func() error) error {
	if capture == "" {
		return fn()
	}
	sc, done := freshStream(w.nc)
	defer done()
	rp, err := relayPool(ctx, w.db.URL)
	if err != nil {
		return err
	}
	defer rp.Close()
	rc := relayConfig()
	rc.Capture, rc.Slot = capture, w.db.Name
	r, err := benchkit.StartRelay(ctx, relay.Options{Relay: rc, Stream: sc, Pool: rp, Conn: w.nc, Logger: quiet, EventTypes: eventTypes()})
	if err != nil {
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
		if err := dropSlot(ctx, w.db.Pool, w.db.Name); err != nil && ferr == nil {
			ferr = err
		}
	}
	return ferr
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
		wg.Go(func() {
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
		})
	}
	wg.Wait()
	return float64(n.Load()) / time.Since(start).Seconds(), firstErr
}
