package relay_test

import (
	"context"
	"log/slog"
	"os"
	"os/signal"

	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

// A relay embedded in another Go program: its settings are its own
// (relay.Config, stream.Config, with their defaults and checks), its
// connections the program's.
func ExampleNew() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, "postgres://app@127.0.0.1:5432/shop")
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		panic(err)
	}
	defer nc.Close()

	cfg := relay.DefaultConfig()
	cfg.BatchSize = 500
	events := stream.DefaultConfig()
	events.Replicas = 3
	for _, err := range []error{cfg.Validate(), events.Validate()} {
		if err != nil {
			panic(err) // names the key: "relay.batch_size must be between 1 and 10000 (got 0)"
		}
	}
	r, err := relay.New(relay.Options{Relay: cfg, Stream: events, Pool: pool, Conn: nc, Logger: slog.Default()})
	if err != nil {
		panic(err)
	}
	if err := r.Start(ctx); err != nil {
		panic(err)
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	_ = r.Stop(sctx) // finishes the batch in flight
}
