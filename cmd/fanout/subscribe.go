package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/internal/opsserver"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"
)

// deps are the shared connections subscribers are built from: Postgres
// always, Redis and the search engine once, when a subscriber uses them.
type deps struct {
	a      *app
	ctx    context.Context
	pool   *pgxpool.Pool
	reg    *prometheus.Registry // nil: serve no metrics
	checks []opsserver.Check

	rdb    *redis.Client
	search *search.Client
}

// build connects what d's declaration uses and builds its handler.
func (d *deps) build(decl subscribers.Declaration) (subscribers.Handler, error) {
	logger := logging.Component(d.a.logger, decl.Name)
	deps := subscribers.Deps{Context: d.ctx, Pool: d.pool, Settings: d.a.cfg, Logger: logger}
	if decl.UsesService(subscribers.Redis) {
		if d.rdb == nil {
			err := waitForDependency(d.ctx, logger, "redis", "ping", func() (err error) {
				d.rdb, err = connect.Redis(d.ctx, d.a.cfg.Redis)
				return err
			})
			if err != nil {
				return subscribers.Handler{}, fmt.Errorf("subscriber %s: %w", decl.Name, err)
			}
		}
		deps.Redis = d.rdb
	}
	if decl.UsesService(subscribers.Search) {
		if d.search == nil {
			err := waitForDependency(d.ctx, logger, "search", "info", func() (err error) {
				d.search, err = search.Connect(d.ctx, d.a.cfg.Search.Client())
				return err
			})
			if err != nil {
				return subscribers.Handler{}, fmt.Errorf("subscriber %s: %w", decl.Name, err)
			}
		}
		deps.Search = d.search
	}
	if d.reg != nil {
		deps.Metrics = d.reg
	}
	// Building may call the services too (the search indexer makes its
	// index): a dependency slow to answer is waited for here as well.
	var h subscribers.Handler
	err := waitForDependency(d.ctx, logger, "the services "+decl.Name+" uses", "build "+decl.Name, func() (err error) {
		h, err = decl.Build(deps)
		return err
	})
	return h, err
}

func (d *deps) close() {
	if d.rdb != nil {
		d.rdb.Close()
	}
}

func subscriberNames() []string { return subscriberRegistry.Names() }

// startSubscribers starts a runner per name; stopAll drains them all within
// subscribers.shutdown_timeout.
func startSubscribers(ctx context.Context, a *app, d *deps, names []string, nc *nats.Conn, obs subscribers.Observer) (stopAll func() error, err error) {
	var runners []*subscribers.Runner
	stopAll = func() error {
		sctx, cancel := context.WithTimeout(context.Background(), a.cfg.Subscribers.ShutdownTimeout)
		defer cancel()
		errs := make([]error, len(runners))
		var wg sync.WaitGroup
		for i, r := range runners {
			wg.Go(func() { errs[i] = r.Stop(sctx) })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	for _, name := range names {
		decl, err := subscriberRegistry.Lookup(name)
		if err != nil {
			_ = stopAll()
			return nil, err
		}
		h, err := d.build(decl)
		if err != nil {
			_ = stopAll()
			return nil, err
		}
		r, err := subscribers.New(subscribers.Options{
			Declaration: decl, Handler: sabotaged(decl, h), Config: a.cfg.Subscriber(name), Stream: a.cfg.Stream,
			Pool: d.pool, Conn: nc, Logger: logging.Component(a.logger, "subscriber"), Observer: obs,
		})
		if err == nil {
			err = r.Start(testhooks.WithSubscriber(ctx, sabotage.subscriber))
		}
		if err != nil {
			_ = stopAll()
			return nil, err
		}
		runners = append(runners, r)
		// Not ready while a dependency the subscriber needs is down (it
		// holds its events meanwhile): Postgres, Redis, the search engine,
		// the dead letters, each probed in the background, so readiness
		// reads state and queries nothing itself.
		d.checks = append(d.checks, opsserver.Check{Name: "subscriber " + name, Fn: func(context.Context) error { return r.Ready() }})
	}
	return stopAll, nil
}

func subscribeCommand(a *app) *cobra.Command {
	var start string
	cmd := &cobra.Command{
		Use:   "subscribe <subscriber>...",
		Short: "Run one or more subscribers until SIGTERM (" + strings.Join(subscriberNames(), ", ") + ")",
		Long: `Run subscribers in this process. Several processes running the same
subscriber share its durable consumer (and its work). SIGTERM drains: no new
events are pulled, the ones in hand finish and are acked, then the process exits.

Subscribers: ` + strings.Join(subscriberNames(), ", ") + `.`,
		Args: cobra.MinimumNArgs(1),
		RunE: a.loaded(func(cmd *cobra.Command, args []string) error {
			if start != "" {
				a.cfg.SetSubscriberStart(start)
				if err := a.cfg.Validate(); err != nil {
					return err
				}
			}
			var ordered []string
			for _, name := range args {
				decl, err := subscriberRegistry.Lookup(name)
				if err != nil {
					return err
				}
				if decl.Ordered {
					ordered = append(ordered, name)
				}
			}
			ctx := cmd.Context()
			c, err := a.openWaiting(ctx, "subscribe")
			if err != nil {
				return err
			}
			defer c.close()
			d := &deps{a: a, ctx: ctx, pool: c.pool, reg: metrics.NewRegistry(), checks: []opsserver.Check{natsCheck(c.nc)}}
			defer d.close()
			stopAll, err := startSubscribers(ctx, a, d, args, c.nc, subscribers.NewMetrics(d.reg))
			if err != nil {
				return err
			}
			d.reg.MustRegister(subscribers.NewConsumerCollector(c.js, a.cfg.Stream.Name, args, a.logger))
			if len(ordered) > 0 {
				d.reg.MustRegister(subscribers.NewHeldAggregatesCollector(c.pool, ordered, a.logger))
			}
			stopOps, err := startOps(a, d.reg, d.checks)
			if err != nil {
				_ = stopAll()
				return err
			}
			defer stopOps()
			waitErr := untilStopOrClosed(ctx, c.nc)
			a.logger.Info("draining subscribers", "subscribers", args)
			return errors.Join(waitErr, stopAll())
		}),
	}
	cmd.Flags().StringVar(&start, "start", "", "where a new subscriber's consumer starts: all, new or time (overrides subscribers.start)")
	return cmd
}
