package main

import (
	"context"
	"fmt"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/relay"
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
			r, cleanup, err := startRelay(cmd.Context(), a, nil)
			if err != nil {
				return err
			}
			defer cleanup()
			<-cmd.Context().Done()
			return stopRelay(a, r)
		},
	}
}

// startRelay connects and starts a relay; cleanup closes its connections.
func startRelay(ctx context.Context, a *app, obs relay.Observer) (*relay.Relay, func(), error) {
	pool, err := a.postgres(ctx, "relay", connect.AsyncCommit())
	if err != nil {
		return nil, nil, err
	}
	nc, err := a.nats("relay")
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	cleanup := func() {
		nc.Close()
		pool.Close()
	}
	r, err := relay.New(relay.Options{
		Relay:    a.cfg.Relay,
		Stream:   a.cfg.Stream,
		Pool:     pool,
		Conn:     nc,
		Logger:   logging.Component(a.logger, "relay"),
		Observer: obs,
	})
	if err == nil {
		err = r.Start(ctx)
	}
	if err != nil {
		cleanup()
		return nil, nil, err
	}
	return r, cleanup, nil
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
