package outbox_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"
)

// The examples run against a real database, nats-server and relay, set up
// once for the package.
var (
	pool *pgxpool.Pool
	js   jetstream.JetStream
)

func TestMain(m *testing.M) {
	code, err := run(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox tests:", err)
		os.Exit(1)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func run(m *testing.M) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db, err := pgtest.Create(ctx, pgtest.AdminURL())
	if err != nil {
		return 0, err
	}
	defer db.Close()
	dir, err := os.MkdirTemp("", "outbox-test-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	server, err := natstest.StartServer(dir)
	if err != nil {
		return 0, err
	}
	defer server.Close()
	nc, err := nats.Connect(server.URL)
	if err != nil {
		return 0, err
	}
	defer nc.Close()

	r, err := relay.New(relay.Options{Relay: relay.DefaultConfig(), Stream: stream.DefaultConfig(), Pool: db.Pool, Conn: nc,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return 0, err
	}
	if err := r.Start(ctx); err != nil {
		return 0, err
	}
	defer r.Stop(context.Background()) //nolint:errcheck

	pool = db.Pool
	if js, err = jetstream.New(nc); err != nil {
		return 0, err
	}
	return m.Run(), nil
}
