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
	"github.com/spf13/cobra"
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

// loaded makes a command's RunE: fn runs once the configuration is loaded.
func (a *app) loaded(fn func(cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		if err := a.load(); err != nil {
			return err
		}
		return fn(cmd, args)
	}
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

// relaySessions are the options of the relay's pool: its sessions commit
// without waiting for the WAL flush and plan without JIT
// (connect.AsyncCommit, connect.NoJIT).
func relaySessions() []connect.PostgresOption {
	return []connect.PostgresOption{connect.AsyncCommit(), connect.NoJIT()}
}

// jetStream connects to NATS as role and returns the connection, for the
// caller to close, and its JetStream API.
func (a *app) jetStream(role string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := connect.NATS(a.cfg.NATS, role, logging.Component(a.logger, "nats"))
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

// What open connects to besides Postgres.
const (
	pgOnly   = false
	withNATS = true
)

// conns are a command's connections, made as its role (open).
type conns struct {
	pool *pgxpool.Pool
	nc   *nats.Conn // nil unless opened withNATS
	js   jetstream.JetStream
}

// open loads the configuration and connects as role: to Postgres (with
// opts), and withNATS to NATS and its JetStream API too. The caller
// closes what it returns.
func (a *app) open(ctx context.Context, role string, nc bool, opts ...connect.PostgresOption) (*conns, error) {
	if err := a.load(); err != nil {
		return nil, err
	}
	pool, err := a.postgres(ctx, role, opts...)
	if err != nil {
		return nil, err
	}
	c := &conns{pool: pool}
	if nc {
		if c.nc, c.js, err = a.jetStream(role); err != nil {
			pool.Close()
			return nil, err
		}
	}
	return c, nil
}

// openWaiting is open withNATS for a role that runs until stopped (the
// relay, the subscribers): Postgres or NATS down, or too slow to answer,
// when it starts is an outage it waits out, logging each try, as it waits
// through one once running; a refused credential or a bad setting still
// ends it at once (waitForDependency).
func (a *app) openWaiting(ctx context.Context, role string, opts ...connect.PostgresOption) (*conns, error) {
	if err := a.load(); err != nil {
		return nil, err
	}
	c := &conns{}
	err := waitForDependency(ctx, a.logger, "postgres", "connect", func() (err error) {
		c.pool, err = a.postgres(ctx, role, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	err = waitForDependency(ctx, a.logger, "nats", "connect", func() (err error) {
		c.nc, c.js, err = a.jetStream(role)
		return err
	})
	if err != nil {
		c.pool.Close()
		return nil, err
	}
	return c, nil
}

func (c *conns) close() {
	if c.nc != nil {
		c.nc.Close()
	}
	c.pool.Close()
}

// connected makes a command's RunE: fn runs with the connections open
// (see open), and they are closed after it.
func (a *app) connected(role string, nc bool, fn func(cmd *cobra.Command, args []string, c *conns) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		c, err := a.open(cmd.Context(), role, nc)
		if err != nil {
			return err
		}
		defer c.close()
		return fn(cmd, args, c)
	}
}
