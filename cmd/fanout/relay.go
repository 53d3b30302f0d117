package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/fanout/fanout/internal/gctune"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/internal/opsserver"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/relay"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"
)

func relayCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "relay",
		Short: "Publish committed outbox rows to the JetStream stream until SIGTERM",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.load(); err != nil {
				return err
			}
			gc := gctune.Apply()
			gogc := gc.GOGC
			if gogc == "" {
				gogc = strconv.Itoa(gctune.Percent)
			}
			a.logger.Info("garbage collector", "gogc", gogc, "memory_limit_bytes", gc.MemoryLimit)
			reg := metrics.NewRegistry()
			r, deps, err := startRelay(cmd.Context(), a, relay.NewMetrics(reg))
			if err != nil {
				return err
			}
			defer deps.close()
			reg.MustRegister(relay.NewOutboxCollector(deps.pool, a.cfg.Relay.OnFailed, a.logger))
			stopOps, err := startOps(a, reg, []opsserver.Check{
				natsCheck(deps.nc), {Name: "relay", Fn: func(context.Context) error { return r.Ready() }},
			})
			if err != nil {
				_ = stopRelay(a, r)
				return err
			}
			defer stopOps()
			waitErr := untilStopOrClosed(cmd.Context(), deps.nc)
			return errors.Join(waitErr, stopRelay(a, r))
		},
	}
}

// relayDeps are a relay's connections.
type relayDeps struct {
	pool *pgxpool.Pool
	nc   *nats.Conn
}

func (d relayDeps) close() {
	d.nc.Close()
	d.pool.Close()
}

// startRelay connects and starts a relay.
func startRelay(ctx context.Context, a *app, obs relay.Observer) (*relay.Relay, relayDeps, error) {
	pool, err := a.relayPostgres(ctx)
	if err != nil {
		return nil, relayDeps{}, err
	}
	nc, err := a.nats("relay")
	if err != nil {
		pool.Close()
		return nil, relayDeps{}, err
	}
	deps := relayDeps{pool: pool, nc: nc}
	r, err := relay.New(relay.Options{
		Relay:    a.cfg.Relay,
		Stream:   a.cfg.Stream,
		Pool:     pool,
		Conn:     nc,
		Logger:   logging.Component(a.logger, "relay"),
		Observer: obs,
	})
	if err == nil {
		err = r.Start(testhooks.WithRelay(ctx, sabotage.relay))
	}
	if err != nil {
		deps.close()
		return nil, relayDeps{}, err
	}
	return r, deps, nil
}

// stopRelay drains the relay within relay.shutdown_timeout.
func stopRelay(a *app, r *relay.Relay) error {
	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.Relay.ShutdownTimeout)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		return fmt.Errorf("graceful stop: %w", err)
	}
	return nil
}
