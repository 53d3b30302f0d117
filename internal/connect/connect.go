// Package connect opens fanout's connections to Postgres, NATS and Redis,
// with the timeouts, names and credentials every role shares. It owns the
// settings it dials with: the postgres.*, nats.* and redis.* keys. The
// search engine's client dials itself (search.Connect): plumbing here
// imports nothing of the product.
package connect

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
)

// PoolConfig builds a pool configuration; role names the connections in
// pg_stat_activity (application_name).
func PoolConfig(cfg PostgresConfig, role string) (*pgxpool.Config, error) {
	pc, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		// pgx's message quotes the URL, its passwords masked by pgx's own
		// best effort; ours masks what pgx might miss.
		return nil, fmt.Errorf("postgres.url: %w", config.RedactError(err, postgresSecrets(cfg)...))
	}
	if cfg.Password != "" {
		pc.ConnConfig.Password = cfg.Password
	}
	pc.MaxConns = cfg.MaxConns
	pc.ConnConfig.ConnectTimeout = cfg.ConnectTimeout
	pc.ConnConfig.RuntimeParams["application_name"] = "fanout-" + role
	if cfg.StatementTimeout > 0 {
		pc.ConnConfig.RuntimeParams["statement_timeout"] = strconv.FormatInt(cfg.StatementTimeout.Milliseconds(), 10)
	}
	pc.HealthCheckPeriod = 15 * time.Second
	return pc, nil
}

// PostgresOption adjusts a role's pool configuration.
type PostgresOption func(*pgxpool.Config)

// AsyncCommit turns synchronous_commit off for the pool's sessions. The
// relay uses it for its own bookkeeping (claims, marks): a commit lost in a
// crash only makes a row go out again, which JetStream and the subscribers'
// checkpoints absorb, while waiting for each WAL flush would halve its
// throughput. Writers' transactions are unaffected.
func AsyncCommit() PostgresOption {
	return func(pc *pgxpool.Config) { pc.ConnConfig.RuntimeParams["synchronous_commit"] = "off" }
}

// NoJIT turns JIT compilation off for the pool's sessions. The relay's
// claims are short statements over every range of the outbox: with a few
// dozen ranges a claim by transactions (relay.atomic transaction) costs
// more than jit_above_cost, and compiling its plan took 0.7 to 1 s of a
// claim that runs in 10 ms without (measured on 30 ranges); under load
// in a fault run, claims took 10 s, past the lease.
func NoJIT() PostgresOption {
	return func(pc *pgxpool.Config) { pc.ConnConfig.RuntimeParams["jit"] = "off" }
}

// Postgres opens a pool and checks that the server answers.
func Postgres(ctx context.Context, cfg PostgresConfig, role string, opts ...PostgresOption) (*pgxpool.Pool, error) {
	pc, err := PoolConfig(cfg, role)
	if err != nil {
		return nil, err
	}
	for _, o := range opts {
		o(pc)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("open postgres pool: %w", config.RedactError(err, postgresSecrets(cfg)...))
	}
	pingCtx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to postgres at %s:%d: %w", pc.ConnConfig.Host, pc.ConnConfig.Port, config.RedactError(err, postgresSecrets(cfg)...))
	}
	return pool, nil
}

// The credentials each connection is given, masked in the errors of the
// client libraries: pgx masks what it quotes, net/url's errors (go-redis's
// ParseURL) quote a URL whole, and the others' messages are not ours to
// vouch for.
func postgresSecrets(cfg PostgresConfig) []string {
	return append(config.URLSecrets(cfg.URL), cfg.Password)
}

func natsSecrets(cfg NATSConfig) []string {
	return append(config.URLSecrets(cfg.URL), cfg.Password, cfg.Token)
}

func redisSecrets(cfg RedisConfig) []string {
	return append(config.URLSecrets(cfg.URL), cfg.Password)
}

// NATS connects to the servers in cfg. The connection reconnects forever
// (a broker restart must not end a role) and never buffers publishes while
// disconnected: the relay wants an immediate error, not a late surprise.
func NATS(cfg NATSConfig, role string, logger *slog.Logger) (*nats.Conn, error) {
	secrets := natsSecrets(cfg)
	opts := []nats.Option{
		nats.Name("fanout-" + role),
		nats.Timeout(cfg.ConnectTimeout),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(500 * time.Millisecond),
		nats.ReconnectJitter(200*time.Millisecond, time.Second),
		nats.ReconnectBufSize(-1),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				logger.Warn("nats disconnected", "error", config.RedactError(err, secrets...))
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			// Not ConnectedUrlRedacted: it masks a password but shows a
			// token given as the URL's user (nats://<token>@host).
			logger.Info("nats reconnected", "server", config.RedactURL(nc.ConnectedUrl()))
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			attrs := []any{"error", config.RedactError(err, secrets...)}
			if sub != nil {
				attrs = append(attrs, "subject", sub.Subject)
			}
			logger.Warn("nats async error", attrs...)
		}),
	}
	switch {
	case cfg.CredsFile != "":
		// No per-user inbox prefix: the user's name is in the JWT, not known here.
		opts = append(opts, nats.UserCredentials(cfg.CredsFile))
	case cfg.Token != "":
		opts = append(opts, nats.Token(cfg.Token))
	case cfg.User != "":
		// Replies (API responses, PubAcks, pulled messages) arrive on
		// _INBOX_<user>.>, which only this user may read (deploy/nats/nats-server.conf).
		opts = append(opts, nats.UserInfo(cfg.User, cfg.Password), nats.CustomInboxPrefix("_INBOX_"+cfg.User))
	}
	if cfg.CAFile != "" {
		opts = append(opts, nats.RootCAs(cfg.CAFile))
	}
	if cfg.CertFile != "" {
		opts = append(opts, nats.ClientCert(cfg.CertFile, cfg.KeyFile))
	}
	nc, err := nats.Connect(cfg.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to nats at %s: %w", config.RedactURL(cfg.URL), config.RedactError(err, secrets...))
	}
	return nc, nil
}

// Redis opens a client and checks that the server answers.
func Redis(ctx context.Context, cfg RedisConfig) (*redis.Client, error) {
	opts, err := redis.ParseURL(cfg.URL)
	if err != nil {
		// A net/url error quotes the URL, password and all.
		return nil, fmt.Errorf("redis.url: %w", config.RedactError(err, redisSecrets(cfg)...))
	}
	if cfg.Password != "" {
		opts.Password = cfg.Password
	}
	opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = cfg.Timeout, cfg.Timeout, cfg.Timeout
	rdb := redis.NewClient(opts)
	pingCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	if err := rdb.Ping(pingCtx).Err(); err != nil {
		rdb.Close()
		return nil, fmt.Errorf("connect to redis at %s: %w", opts.Addr, config.RedactError(err, redisSecrets(cfg)...))
	}
	return rdb, nil
}
