package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/internal/demo"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema"
	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
)

func demoCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "demo",
		Short: "Run the demo writer: price and stock changes, orders, renames, at demo.rate writes/s",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.load(); err != nil {
				return err
			}
			pool, err := a.postgres(cmd.Context(), "demo")
			if err != nil {
				return err
			}
			defer pool.Close()
			d, err := newDriver(cmd.Context(), a, pool)
			if err != nil {
				return err
			}
			go progress(cmd.Context(), a, pool, d, nil)
			return d.Run(cmd.Context())
		},
	}
}

func upCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "up",
		Short: "Migrate, then run the relay and the demo writer with a progress line (the services must be up: `go tool task up` starts them)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.load(); err != nil {
				return err
			}
			ctx := cmd.Context()
			pool, err := a.postgres(ctx, "up")
			if err != nil {
				return err
			}
			defer pool.Close()
			if _, err := schema.Migrate(ctx, pool, logging.Component(a.logger, "migrate")); err != nil {
				return err
			}
			var published atomic.Int64
			r, deps, err := startRelay(ctx, a, countPublished{&published})
			if err != nil {
				return err
			}
			defer deps.close()
			d, err := newDriver(ctx, a, pool)
			if err != nil {
				_ = stopRelay(a, r)
				return err
			}
			fmt.Printf("fanout up: relay publishing to stream %s on %s; demo writing %d/s. Try: .bin/nats stream info %s. Ctrl-C stops.\n",
				a.cfg.Stream.Name, a.cfg.NATS.URL, a.cfg.Demo.Rate, a.cfg.Stream.Name)
			go progress(ctx, a, pool, d, &published)
			runErr := d.Run(ctx)
			if err := stopRelay(a, r); err != nil {
				return err
			}
			return runErr
		},
	}
}

func newDriver(ctx context.Context, a *app, pool *pgxpool.Pool) (*demo.Driver, error) {
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	n, err := shop.Seed(ctx, pool, a.cfg.Demo.Products, rng)
	if err != nil {
		return nil, err
	}
	if n > 0 {
		a.logger.Info("seeded the catalog", "products", n)
	}
	return &demo.Driver{Pool: pool, Rate: a.cfg.Demo.Rate, Mix: demo.DefaultMix, Rand: rng, Logger: logging.Component(a.logger, "demo")}, nil
}

// countPublished counts the relay's published rows for the progress line.
type countPublished struct{ n *atomic.Int64 }

func (c countPublished) Claimed(int, time.Duration)     {}
func (c countPublished) Published(ev []relay.Published) { c.n.Add(int64(len(ev))) }
func (c countPublished) Retried(int)                    {}
func (c countPublished) Failed(int)                     {}
func (c countPublished) Reaped(int)                     {}
func (c countPublished) Deleted(int)                    {}

// progress prints a line every demo.progress_interval until ctx ends.
func progress(ctx context.Context, a *app, pool *pgxpool.Pool, d *demo.Driver, published *atomic.Int64) {
	t := time.NewTicker(a.cfg.Demo.ProgressInterval)
	defer t.Stop()
	start := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		var pending, sending, failed int64
		err := pool.QueryRow(qctx, `
SELECT count(*) FILTER (WHERE status = 'pending'),
       count(*) FILTER (WHERE status = 'sending'),
       count(*) FILTER (WHERE status = 'failed')
FROM outbox WHERE status <> 'sent'`).Scan(&pending, &sending, &failed)
		cancel()
		if err != nil {
			a.logger.Warn("progress query", "error", err)
			continue
		}
		line := fmt.Sprintf("[%5.0fs] written %d (%.0f/s)", time.Since(start).Seconds(), d.Written(), float64(d.Written())/time.Since(start).Seconds())
		if published != nil {
			line += fmt.Sprintf("  published %d", published.Load())
		}
		line += fmt.Sprintf("  backlog %d (pending %d, sending %d)  failed %d", pending+sending, pending, sending, failed)
		fmt.Println(line)
	}
}
