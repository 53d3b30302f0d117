package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/internal/opsserver"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/shop/demo"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

func demoCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "demo",
		Short: "Run the demo writer: price and stock changes, orders, renames, at demo.rate writes/s",
		Args:  cobra.NoArgs,
		RunE: a.connected("demo", pgOnly, func(cmd *cobra.Command, _ []string, c *conns) error {
			d, err := newDriver(cmd.Context(), a, c.pool)
			if err != nil {
				return err
			}
			go progress(cmd.Context(), a, c.pool, d, nil, nil, nil)
			return d.Run(cmd.Context())
		}),
	}
}

func upCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "up",
		Short: "Migrate, then run the relay, every subscriber and the demo writer in one process, with a progress line (`go tool task up` starts the services first)",
		Args:  cobra.NoArgs,
		RunE: a.connected("up", pgOnly, func(cmd *cobra.Command, _ []string, c *conns) error {
			ctx, pool := cmd.Context(), c.pool
			if _, err := schema.Migrate(ctx, pool, logging.Component(a.logger, "migrate")); err != nil {
				return err
			}
			// What is started is stopped in reverse order, once, however
			// up ends: the subscribers drain before the relay stops.
			var running supervisor
			defer func() { _ = running.stop() }()
			var published atomic.Int64
			reg := metrics.NewRegistry()
			r, rc, err := startRelay(ctx, a, countPublished{Observer: relay.NewMetrics(reg), n: &published})
			if err != nil {
				return err
			}
			running.add(func() error { rc.close(); return nil })
			running.add(func() error { return stopRelay(a, r) })
			names := subscriberNames()
			sd := &deps{a: a, ctx: ctx, pool: pool, reg: reg, checks: []opsserver.Check{
				natsCheck(rc.nc), {Name: "relay", Fn: func(context.Context) error { return r.Ready() }},
			}}
			running.add(func() error { sd.close(); return nil })
			stopSubscribers, err := startSubscribers(ctx, a, sd, names, rc.nc, subscribers.NewMetrics(reg))
			if err != nil {
				return err
			}
			running.add(stopSubscribers)
			reg.MustRegister(relay.NewOutboxCollector(pool, a.cfg.Relay.OnFailed, a.logger), subscribers.NewConsumerCollector(rc.js, a.cfg.Stream.Name, names, a.logger))
			stopOps, err := startOps(a, reg, sd.checks)
			if err != nil {
				return err
			}
			running.add(func() error { stopOps(); return nil })
			d, err := newDriver(ctx, a, pool)
			if err != nil {
				return err
			}
			fmt.Printf("fanout up: relay publishing to stream %s on %s, subscribers %s, demo writing %d/s.\n"+
				"Try: .bin/nats stream info %s, or go run ./cmd/fanout status. Ctrl-C stops.\n",
				a.cfg.Stream.Name, config.RedactURL(a.cfg.NATS.URL), strings.Join(names, ", "), a.cfg.Demo.Rate, a.cfg.Stream.Name)
			go progress(ctx, a, pool, d, &published, rc.js, names)
			runErr := d.Run(ctx)
			return errors.Join(runErr, running.stop())
		}),
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

// countPublished counts the relay's published rows for the progress line,
// and tells Observer.
type countPublished struct {
	relay.Observer
	n *atomic.Int64
}

func (c countPublished) Published(ev []relay.Published) {
	c.n.Add(int64(len(ev)))
	c.Observer.Published(ev)
}

// supervisor stops what up started, in reverse order, once.
type supervisor struct {
	once  sync.Once
	stops []func() error
	err   error
}

func (s *supervisor) add(stop func() error) { s.stops = append(s.stops, stop) }

func (s *supervisor) stop() error {
	s.once.Do(func() {
		var errs []error
		for i := len(s.stops) - 1; i >= 0; i-- {
			errs = append(errs, s.stops[i]())
		}
		s.err = errors.Join(errs...)
	})
	return s.err
}

// progress prints a line every demo.progress_interval until ctx ends.
func progress(ctx context.Context, a *app, pool *pgxpool.Pool, d *demo.Driver, published *atomic.Int64, js jetstream.JetStream, names []string) {
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
		b, err := outboxstore.New(pool).Backlog(qctx)
		pending, sending, failed := b.Pending, b.Sending, b.Failed
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
		if js != nil {
			var invoices int64
			_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&invoices)
			line += fmt.Sprintf("  invoices %d  lag", invoices)
			for _, n := range names {
				lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				lag := "?"
				if c, err := js.Consumer(lctx, a.cfg.Stream.Name, n); err == nil {
					if info, err := c.Info(lctx); err == nil {
						lag = fmt.Sprint(info.NumPending + uint64(info.NumAckPending))
					}
				}
				cancel()
				line += " " + n + "=" + lag
			}
		}
		fmt.Println(line)
	}
}
