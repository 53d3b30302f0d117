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
	"github.com/fanout/fanout/shop"
	"github.com/spf13/cobra"
)

func relayCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "relay",
		Short: "Publish committed outbox rows to the JetStream stream until SIGTERM",
		Args:  cobra.NoArgs,
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
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
		}),
	}
}

// startRelay connects and starts a relay.
func startRelay(ctx context.Context, a *app, obs relay.Observer) (*relay.Relay, *conns, error) {
	c, err := a.openWaiting(ctx, "relay", relaySessions()...)
	if err != nil {
		return nil, nil, err
	}
	r, err := relay.New(relay.Options{
		Relay:    a.cfg.Relay,
		Stream:   a.cfg.Stream,
		Pool:     c.pool,
		Conn:     c.nc,
		Logger:   logging.Component(a.logger, "relay"),
		Observer: obs,
		// The binary's declarations are the shop's, as its subscribers are.
		EventTypes: shop.EventTypes,
	})
	if err == nil {
		err = r.Start(testhooks.WithRelay(ctx, sabotage.relay))
	}
	if err != nil {
		c.close()
		return nil, nil, err
	}
	return r, c, nil
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
