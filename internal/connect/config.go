package connect

import (
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/validate"
)

// PostgresConfig is the connection to the source of truth (the
// postgres.* keys).
type PostgresConfig struct {
	// URL is a libpq-style connection URL. Default DefaultPostgresURL.
	// Put the password in Password or PasswordFile, not here.
	URL string `koanf:"url"`
	// Password overrides any password in URL. Secret. Default empty.
	Password string `koanf:"password"`
	// PasswordFile is read for Password when Password is empty. Default empty.
	PasswordFile string `koanf:"password_file"`
	// MaxConns bounds the pool. Default 10, 1..1000.
	MaxConns int32 `koanf:"max_conns"`
	// ConnectTimeout bounds each connection attempt. Default 5s, > 0.
	ConnectTimeout time.Duration `koanf:"connect_timeout"`
	// StatementTimeout bounds every statement on the server. Default 30s, >= 0 (0 = none).
	StatementTimeout time.Duration `koanf:"statement_timeout"`
}

// NATSConfig is the connection to the broker (the nats.* keys).
type NATSConfig struct {
	// URL is one or more comma-separated server URLs. Default DefaultNATSURL.
	URL string `koanf:"url"`
	// User and Password authenticate with a user/password pair. Secret. Default empty.
	User         string `koanf:"user"`
	Password     string `koanf:"password"`
	PasswordFile string `koanf:"password_file"`
	// Token authenticates with a token. Secret. Default empty.
	Token     string `koanf:"token"`
	TokenFile string `koanf:"token_file"`
	// CredsFile is a .creds file (JWT + nkey seed). Default empty.
	CredsFile string `koanf:"creds_file"`
	// CAFile is a PEM file of CAs to verify the server with (tls:// URLs,
	// or servers that require TLS). Default empty (system roots).
	CAFile string `koanf:"ca_file"`
	// CertFile and KeyFile are a client certificate for mutual TLS.
	// Default empty.
	CertFile string `koanf:"cert_file"`
	KeyFile  string `koanf:"key_file"`
	// ConnectTimeout bounds each connection attempt. Default 5s, > 0.
	ConnectTimeout time.Duration `koanf:"connect_timeout"`
	// RequestTimeout bounds each JetStream API call. Default 10s, > 0.
	RequestTimeout time.Duration `koanf:"request_timeout"`
}

// RedisConfig is the cache the cache invalidator keeps honest (the
// redis.* keys).
type RedisConfig struct {
	// URL is redis://[user@]host:port/db. Default DefaultRedisURL.
	URL string `koanf:"url"`
	// Password overrides any password in URL. Secret. Default empty.
	Password     string `koanf:"password"`
	PasswordFile string `koanf:"password_file"`
	// Timeout bounds each command. Default 2s, > 0.
	Timeout time.Duration `koanf:"timeout"`
	// TombstoneTTL is how long an invalidated product refuses cache fills:
	// longer than the slowest fill (a fill gives up after Timeout, twice),
	// so a fill that read the old row cannot write it back. Default 10s,
	// more than twice Timeout.
	TombstoneTTL time.Duration `koanf:"tombstone_ttl"`
}

// The services of a development machine (deploy/services.sh).
const (
	DefaultPostgresURL = "postgres://fanout@127.0.0.1:55432/fanout?sslmode=disable"
	DefaultNATSURL     = "nats://127.0.0.1:4222"
	DefaultRedisURL    = "redis://127.0.0.1:56379/0"
)

// DefaultPostgres returns the postgres.* defaults.
func DefaultPostgres() PostgresConfig {
	return PostgresConfig{URL: DefaultPostgresURL, MaxConns: 10, ConnectTimeout: 5 * time.Second, StatementTimeout: 30 * time.Second}
}

// DefaultNATS returns the nats.* defaults.
func DefaultNATS() NATSConfig {
	return NATSConfig{URL: DefaultNATSURL, ConnectTimeout: 5 * time.Second, RequestTimeout: 10 * time.Second}
}

// DefaultRedis returns the redis.* defaults.
func DefaultRedis() RedisConfig {
	return RedisConfig{URL: DefaultRedisURL, Timeout: 2 * time.Second, TombstoneTTL: 10 * time.Second}
}

// Validate checks the postgres.* keys, naming every key that is wrong.
func (c PostgresConfig) Validate() error {
	var v validate.Errors
	if u, err := url.Parse(c.URL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		v.Bad("postgres.url", "must be a postgres:// URL (got %q)", config.RedactURL(c.URL))
	}
	v.Between("postgres.max_conns", int64(c.MaxConns), 1, 1000)
	v.Positive("postgres.connect_timeout", c.ConnectTimeout)
	if c.StatementTimeout < 0 {
		v.Bad("postgres.statement_timeout", "must be 0 (none) or a positive duration (got %s)", c.StatementTimeout)
	}
	return v.Err()
}

// Validate checks the nats.* keys, naming every key that is wrong.
func (c NATSConfig) Validate() error {
	var v validate.Errors
	for _, raw := range strings.Split(c.URL, ",") {
		u, err := url.Parse(strings.TrimSpace(raw))
		if err != nil || !slices.Contains([]string{"nats", "tls", "ws", "wss"}, u.Scheme) {
			v.Bad("nats.url", "must be a comma-separated list of nats:// or tls:// URLs (got %q)", config.RedactURL(raw))
		}
	}
	if (c.CertFile == "") != (c.KeyFile == "") {
		v.Bad("nats.cert_file", "and nats.key_file must be set together (got cert %q, key %q)", c.CertFile, c.KeyFile)
	}
	v.Positive("nats.connect_timeout", c.ConnectTimeout)
	v.Positive("nats.request_timeout", c.RequestTimeout)
	return v.Err()
}

// Validate checks the redis.* keys, alone and together, naming every key
// that is wrong.
func (c RedisConfig) Validate() error {
	var v validate.Errors
	if u, err := url.Parse(c.URL); err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") {
		v.Bad("redis.url", "must be a redis:// or rediss:// URL (got %q)", config.RedactURL(c.URL))
	}
	v.Positive("redis.timeout", c.Timeout)
	// A cache fill that read a row before an invalidation may write it
	// after; the tombstone must outlive the slowest fill (a read and a
	// write, each bounded by redis.timeout).
	if c.TombstoneTTL <= 2*c.Timeout {
		v.Bad("redis.tombstone_ttl", "(%s) must be longer than twice redis.timeout (%s), the longest a cache fill can take, or a stale fill could overwrite an invalidation", c.TombstoneTTL, c.Timeout)
	}
	return v.Err()
}
