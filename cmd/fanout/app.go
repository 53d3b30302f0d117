package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/tracing"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// app holds what every subcommand loads: the configuration and the logger.
type app struct {
	configPath *string
	cfg        *Config
	logger     *slog.Logger

	shutdownTracing func()
}

func (a *app) load() error {
	if a.cfg != nil {
		return nil
	}
	cfg, err := loadConfig(*a.configPath, os.Environ(), subscriberNames()...)
	if err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	a.cfg = cfg
	a.logger = logging.New(os.Stderr, cfg.Log.Format, cfg.Log.Level)
	shutdown, err := tracing.Setup(context.Background(), cfg.Tracing, os.Stderr, logging.Component(a.logger, "tracing"))
	if err != nil {
		return err
	}
	a.shutdownTracing = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := shutdown(ctx); err != nil {
			a.logger.Warn("flushing spans", "exporter", cfg.Tracing.Exporter, "error", err)
		}
	}
	return nil
}

// close flushes what the process still holds (spans).
func (a *app) close() {
	if a.shutdownTracing != nil {
		a.shutdownTracing()
	}
}

func (a *app) postgres(ctx context.Context, role string, opts ...connect.PostgresOption) (*pgxpool.Pool, error) {
	return connect.Postgres(ctx, a.cfg.Postgres, role, opts...)
}

// relayPostgres opens the relay's pool: its sessions commit without
// waiting for the WAL flush and plan without JIT (connect.AsyncCommit,
// connect.NoJIT).
func (a *app) relayPostgres(ctx context.Context) (*pgxpool.Pool, error) {
	return a.postgres(ctx, "relay", connect.AsyncCommit(), connect.NoJIT())
}

func (a *app) nats(role string) (*nats.Conn, error) {
	return connect.NATS(a.cfg.NATS, role, logging.Component(a.logger, "nats"))
}

// jetStream connects to NATS as role and returns the connection, for the
// caller to close, and its JetStream API.
func (a *app) jetStream(role string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := a.nats(role)
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}
