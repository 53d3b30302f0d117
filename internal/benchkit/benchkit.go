// Package benchkit holds what the benchmark programs under bench/ share:
// publishing a prepared outbox backlog, and waiting for a subscriber to
// drain it.
package benchkit

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/relay"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Quiet is a logger that drops everything.
var Quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Publish runs a relay until every outbox row is sent.
func Publish(ctx context.Context, pool *pgxpool.Pool, nc *nats.Conn, rc config.Relay, sc config.Stream) error {
	r, err := relay.New(relay.Options{Relay: rc, Stream: sc, Pool: pool, Conn: nc, Logger: Quiet})
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	defer r.Stop(ctx) //nolint:errcheck
	for {
		var left int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status <> 'sent'`).Scan(&left); err != nil {
			return err
		}
		if left == 0 {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// WaitDrained waits until the subscriber's consumer has received and acked
// everything (and acked at least one event), for at most limit.
func WaitDrained(ctx context.Context, js jetstream.JetStream, stream, name string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		time.Sleep(50 * time.Millisecond)
		c, err := js.Consumer(ctx, stream, name)
		if err != nil {
			return err
		}
		info, err := c.Info(ctx)
		if err != nil {
			return err
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not drained after %s: %d pending, %d ack pending", name, limit, info.NumPending, info.NumAckPending)
		}
	}
}
