package config

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/go-viper/mapstructure/v2"
	"github.com/knadh/koanf/parsers/yaml"
	"github.com/knadh/koanf/providers/confmap"
	"github.com/knadh/koanf/providers/file"
	"github.com/knadh/koanf/v2"
)

// Config is the whole configuration of every role. Each field's comment
// states its default and valid range; the defaults are the constants below.
type Config struct {
	Postgres    Postgres    `koanf:"postgres"`
	NATS        NATS        `koanf:"nats"`
	Stream      Stream      `koanf:"stream"`
	Relay       Relay       `koanf:"relay"`
	Subscribers Subscribers `koanf:"subscribers"`
	Redis       Redis       `koanf:"redis"`
	Search      Search      `koanf:"search"`
	HTTP        HTTP        `koanf:"http"`
	Tracing     Tracing     `koanf:"tracing"`
	Log         Log         `koanf:"log"`
	Demo        Demo        `koanf:"demo"`

	// overrides are the settings of the subscribers that set
	// subscribers.<name>.* keys (see Subscriber).
	overrides map[string]Subscribers
}

// Postgres is the connection to the source of truth.
type Postgres struct {
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

// NATS is the connection to the broker.
type NATS struct {
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

// Stream is the JetStream stream that carries the events (package relay
// owns its settings and their checks).
type Stream = stream.Config

// Relay moves outbox rows onto the stream (package relay owns its settings
// and their checks).
type Relay = relay.Config

// Subscribers configures every subscriber's consumer and runtime (package
// subscribers owns its settings and their checks).
type Subscribers = subscribers.Config

// Redis is the cache the cache invalidator keeps honest.
type Redis struct {
	// URL is redis://[user@]host:port/db. Default DefaultRedisURL.
	URL string `koanf:"url"`
	// Password overrides any password in URL. Secret. Default empty.
	Password     string `koanf:"password"`
	PasswordFile string `koanf:"password_file"`
	// Timeout bounds each command. Default 2s, > 0.
	Timeout time.Duration `koanf:"timeout"`
	// TombstoneTTL is how long an invalidated product refuses cache fills:
	// longer than the slowest fill (a fill gives up after Timeout, twice),
	// so a fill that read the old row cannot write it back. Default 10s.
	TombstoneTTL time.Duration `koanf:"tombstone_ttl"`
}

// Search is the search engine and the product index (package searchindex
// owns the type).
type Search = searchindex.Config

// HTTP is each role's operations endpoint: /metrics, /livez, /readyz.
type HTTP struct {
	// Addr is host:port to listen on; empty disables the endpoint.
	// Default 127.0.0.1:9464 (containers set 0.0.0.0:9464).
	Addr string `koanf:"addr"`
	// Peers are the operations endpoints (host:port, comma-separated) of
	// the running roles, which `fanout status` reads the last minute's
	// stage latencies from. Empty: Addr, where `fanout up` serves every
	// role's. Default empty.
	Peers string `koanf:"peers"`
}

// PeerList is Peers as a list, or Addr when Peers is empty (and nothing
// when both are). An address listening on every interface (0.0.0.0:9464,
// :9464) is read on the loopback.
func (h HTTP) PeerList() []string {
	raw := h.Peers
	if strings.TrimSpace(raw) == "" {
		raw = h.Addr
	}
	var out []string
	for _, p := range strings.Split(raw, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		host, port, err := net.SplitHostPort(p)
		if err == nil && port == "0" {
			continue // a port picked at start: nothing to find there
		}
		if err == nil && (host == "" || host == "0.0.0.0" || host == "::") {
			p = net.JoinHostPort("127.0.0.1", port)
		}
		out = append(out, p)
	}
	return out
}

// Tracing is OpenTelemetry tracing. The W3C trace context always travels
// from writers to handlers; spans are exported only if an exporter is set.
type Tracing struct {
	// Exporter is none, stdout (spans as JSON on stderr) or otlp (OTLP over
	// HTTP to a collector). Default none.
	Exporter string `koanf:"exporter"`
	// OTLPEndpoint is the collector's full traces URL for exporter otlp,
	// such as http://otel-collector:4318/v1/traces. Empty: the standard
	// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT
	// variable, else http://localhost:4318/v1/traces. Headers (say, an API
	// key) come from OTEL_EXPORTER_OTLP_HEADERS. Default empty.
	OTLPEndpoint string `koanf:"otlp_endpoint"`
}

// Log is the process log.
type Log struct {
	// Level is debug, info, warn or error. Default info.
	Level string `koanf:"level"`
	// Format is json, text, or auto (text on a terminal, else json). Default auto.
	Format string `koanf:"format"`
}

// Demo drives the demo writer of `fanout up` and `fanout demo`.
type Demo struct {
	// Rate is writes per second. Default 50, 1..100000.
	Rate int `koanf:"rate"`
	// Products seeded when the catalog is empty. Default 1000, 1..10000000.
	Products int `koanf:"products"`
	// ProgressInterval is how often a progress line is printed. Default 5s, > 0.
	ProgressInterval time.Duration `koanf:"progress_interval"`
}

// Defaults, named so that code and docs can refer to them.
const (
	DefaultPostgresURL = "postgres://fanout@127.0.0.1:55432/fanout?sslmode=disable"
	DefaultNATSURL     = "nats://127.0.0.1:4222"
	DefaultStreamName  = stream.DefaultName
	DefaultSubjectRoot = stream.DefaultSubjectPrefix
	DefaultBatchSize   = relay.DefaultBatchSize
	DefaultMaxInFlight = relay.DefaultMaxInFlight
	DefaultLease       = relay.DefaultLease
	DefaultRedisURL    = "redis://127.0.0.1:56379/0"
	DefaultSearchURL   = searchindex.DefaultURL
)

// defaults lists every key and its default value. A key not listed here is
// unknown, and Load rejects it.
func defaults() map[string]any {
	return map[string]any{
		"postgres.url":               DefaultPostgresURL,
		"postgres.password":          "",
		"postgres.password_file":     "",
		"postgres.max_conns":         10,
		"postgres.connect_timeout":   "5s",
		"postgres.statement_timeout": "30s",

		"nats.url":             DefaultNATSURL,
		"nats.user":            "",
		"nats.password":        "",
		"nats.password_file":   "",
		"nats.token":           "",
		"nats.token_file":      "",
		"nats.creds_file":      "",
		"nats.ca_file":         "",
		"nats.cert_file":       "",
		"nats.key_file":        "",
		"nats.connect_timeout": "5s",
		"nats.request_timeout": "10s",

		"stream.name":             DefaultStreamName,
		"stream.subject_prefix":   DefaultSubjectRoot,
		"stream.replicas":         1,
		"stream.max_age":          "168h",
		"stream.max_bytes":        -1,
		"stream.duplicate_window": "10m",
		"stream.provision":        "auto",

		"relay.batch_size":       DefaultBatchSize,
		"relay.max_in_flight":    DefaultMaxInFlight,
		"relay.publish_timeout":  "10s",
		"relay.lease":            DefaultLease.String(),
		"relay.poll_interval":    "500ms",
		"relay.listen":           true,
		"relay.reap_interval":    "10s",
		"relay.retry_min":        "1s",
		"relay.retry_max":        "5m",
		"relay.sent_retention":   "1h",
		"relay.partition_size":   relay.DefaultPartitionSize,
		"relay.cleanup_interval": "1m",
		"relay.cleanup_batch":    1000,
		"relay.shutdown_timeout": "30s",
		"relay.stall_after":      "30s",
		"relay.capture":          relay.CapturePoll,
		"relay.slot":             relay.DefaultSlot,
		"relay.on_failed":        "hold",

		"subscribers.concurrency":                4,
		"subscribers.batch_size":                 100,
		"subscribers.ack_wait":                   "30s",
		"subscribers.handler_timeout":            "20s",
		"subscribers.max_failures":               10,
		"subscribers.max_crashes":                3,
		"subscribers.max_ack_pending":            1000,
		"subscribers.retry_min":                  "1s",
		"subscribers.retry_max":                  "1m",
		"subscribers.start":                      "all",
		"subscribers.start_time":                 "",
		"subscribers.dead_letter_stream":         "DEADLETTER",
		"subscribers.dead_letter_max_age":        "720h",
		"subscribers.dead_letter_provision":      "auto",
		"subscribers.dead_letter_subject_prefix": "deadletter",
		"subscribers.shutdown_timeout":           "30s",
		"subscribers.stall_after":                "2m",
		"subscribers.on_dead_letter":             "hold",
		"subscribers.gap_wait":                   "0s",
		"subscribers.pinned_ttl":                 "15s",

		"redis.url":           DefaultRedisURL,
		"redis.password":      "",
		"redis.password_file": "",
		"redis.timeout":       "2s",
		"redis.tombstone_ttl": "10s",

		"search.engine":               "elasticsearch",
		"search.url":                  DefaultSearchURL,
		"search.username":             "",
		"search.password":             "",
		"search.password_file":        "",
		"search.ca_file":              "",
		"search.insecure_skip_verify": false,
		"search.timeout":              "10s",
		"search.alias":                "products",
		"search.provision":            "auto",
		"search.bulk_size":            1000,
		"search.refresh_after":        "200ms",
		"search.reindex_max_failures": 0,

		"http.addr":  "127.0.0.1:9464",
		"http.peers": "",

		"tracing.exporter":      "none",
		"tracing.otlp_endpoint": "",

		"log.level":  "info",
		"log.format": "auto",

		"demo.rate":              50,
		"demo.products":          1000,
		"demo.progress_interval": "5s",
	}
}

// replacedKeys are keys of earlier versions, with what replaced them: an
// old file or variable is refused with this, not silently ignored.
var replacedKeys = map[string]string{
	"subscribers.max_deliver": "replaced by subscribers.max_failures (handler failures before the dead letters; " +
		"JetStream now redelivers without limit, and deliveries lost to an outage or a crash no longer count) " +
		"and subscribers.max_crashes",
	"http.ready_max_pending_age": "replaced by relay.stall_after: a relay is not ready when it makes no progress, " +
		"no longer when the table holds an old row (one row backing off used to take every relay out of rotation)",
}

// Keys returns every configuration key, sorted.
func Keys() []string {
	d := defaults()
	keys := make([]string, 0, len(d))
	for k := range d {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// EnvPrefix starts every environment variable that sets a key.
const EnvPrefix = "FANOUT_"

// EnvName returns the environment variable that sets key.
func EnvName(key string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(key, ".", "_"))
}

// envNotKeys are FANOUT_ variables that are not configuration keys: the
// config file path, and the prefixes used by the tests and dev scripts.
var envNotKeys = []string{"FANOUT_CONFIG", "FANOUT_TEST_", "FANOUT_DEV_"}

// Load builds the configuration from the defaults, the YAML file at path (if
// path is not empty) and the FANOUT_ variables in environ (as os.Environ
// returns them), then validates it.
func Load(path string, environ []string, opts ...LoadOption) (*Config, error) {
	var o loadOptions
	for _, opt := range opts {
		opt(&o)
	}
	if err := checkSubscriberNames(o.subscribers); err != nil {
		return nil, err
	}
	known := defaults()
	for _, key := range SubscriberOverrideKeys(o.subscribers...) {
		known[key] = nil
	}
	k := koanf.New(".")
	if err := k.Load(confmap.Provider(defaults(), "."), nil); err != nil {
		return nil, fmt.Errorf("load defaults: %w", err)
	}
	if path != "" {
		if err := k.Load(file.Provider(path), yaml.Parser()); err != nil {
			return nil, fmt.Errorf("read config file %s: %w", path, err)
		}
	}
	env, err := envValues(environ, known)
	if err != nil {
		return nil, err
	}
	if err := k.Load(confmap.Provider(env, "."), nil); err != nil {
		return nil, fmt.Errorf("load environment: %w", err)
	}

	for _, key := range k.Keys() {
		if why, ok := replacedKeys[key]; ok {
			return nil, fmt.Errorf("config key %q is gone: %s", key, why)
		}
		if _, ok := known[key]; !ok {
			return nil, fmt.Errorf("unknown config key %q (see `fanout config keys`)", key)
		}
	}

	var cfg Config
	err = k.UnmarshalWithConf("", &cfg, koanf.UnmarshalConf{
		DecoderConfig: &mapstructure.DecoderConfig{
			DecodeHook: mapstructure.ComposeDecodeHookFunc(
				mapstructure.StringToTimeDurationHookFunc(),
			),
			WeaklyTypedInput: true,
			Result:           &cfg,
			TagName:          "koanf",
		},
	})
	if err != nil {
		return nil, fmt.Errorf("decode config: %w", err)
	}
	if err := cfg.decodeOverrides(k, o.subscribers); err != nil {
		return nil, err
	}
	if err := cfg.readSecretFiles(); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &cfg, nil
}

// envValues maps FANOUT_* variables onto keys. Matching against the known
// keys, rather than splitting on "_", is what lets keys contain underscores.
func envValues(environ []string, known map[string]any) (map[string]any, error) {
	byEnv := make(map[string]string)
	for key := range known {
		byEnv[EnvName(key)] = key
	}
	out := make(map[string]any)
	for _, kv := range environ {
		name, value, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, EnvPrefix) {
			continue
		}
		if slices.ContainsFunc(envNotKeys, func(p string) bool { return strings.HasPrefix(name, p) }) {
			continue
		}
		key, ok := byEnv[name]
		for old, why := range replacedKeys {
			if name == EnvName(old) {
				return nil, fmt.Errorf("environment variable %s: config key %q is gone: %s", name, old, why)
			}
		}
		if !ok {
			return nil, fmt.Errorf("environment variable %s names no config key (see `fanout config keys`)", name)
		}
		out[key] = value
	}
	return out, nil
}

func (c *Config) readSecretFiles() error {
	for _, s := range []struct {
		key   string
		path  string
		value *string
	}{
		{"postgres.password_file", c.Postgres.PasswordFile, &c.Postgres.Password},
		{"nats.password_file", c.NATS.PasswordFile, &c.NATS.Password},
		{"nats.token_file", c.NATS.TokenFile, &c.NATS.Token},
		{"redis.password_file", c.Redis.PasswordFile, &c.Redis.Password},
		{"search.password_file", c.Search.PasswordFile, &c.Search.Password},
	} {
		if s.path == "" || *s.value != "" {
			continue
		}
		b, err := os.ReadFile(s.path)
		if err != nil {
			return fmt.Errorf("%s: %w", s.key, err)
		}
		*s.value = strings.TrimRight(string(b), "\r\n")
	}
	return nil
}

// Validate checks every key and returns all problems found, each naming its
// key and what is allowed.
func (c *Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s %s", key, fmt.Sprintf(format, args...)))
	}
	between := func(key string, v, lo, hi int64) {
		if v < lo || v > hi {
			bad(key, "must be between %d and %d (got %d)", lo, hi, v)
		}
	}
	positive := func(key string, d time.Duration) {
		if d <= 0 {
			bad(key, "must be a positive duration such as 5s (got %s)", d)
		}
	}
	oneOf := func(key, v string, allowed ...string) {
		if !slices.Contains(allowed, v) {
			bad(key, "must be one of %s (got %q)", strings.Join(allowed, ", "), v)
		}
	}

	if u, err := url.Parse(c.Postgres.URL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		bad("postgres.url", "must be a postgres:// URL (got %q)", RedactURL(c.Postgres.URL))
	}
	between("postgres.max_conns", int64(c.Postgres.MaxConns), 1, 1000)
	positive("postgres.connect_timeout", c.Postgres.ConnectTimeout)
	if c.Postgres.StatementTimeout < 0 {
		bad("postgres.statement_timeout", "must be 0 (none) or a positive duration (got %s)", c.Postgres.StatementTimeout)
	}

	for _, raw := range strings.Split(c.NATS.URL, ",") {
		u, err := url.Parse(strings.TrimSpace(raw))
		if err != nil || !slices.Contains([]string{"nats", "tls", "ws", "wss"}, u.Scheme) {
			bad("nats.url", "must be a comma-separated list of nats:// or tls:// URLs (got %q)", RedactURL(raw))
		}
	}
	if (c.NATS.CertFile == "") != (c.NATS.KeyFile == "") {
		bad("nats.cert_file", "and nats.key_file must be set together (got cert %q, key %q)", c.NATS.CertFile, c.NATS.KeyFile)
	}
	positive("nats.connect_timeout", c.NATS.ConnectTimeout)
	positive("nats.request_timeout", c.NATS.RequestTimeout)

	for _, err := range []error{c.Stream.Validate(), c.Relay.Validate()} {
		if err != nil {
			errs = append(errs, err)
		}
	}

	if err := c.Subscribers.Validate(); err != nil {
		errs = append(errs, err)
	}

	if u, err := url.Parse(c.Redis.URL); err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") {
		bad("redis.url", "must be a redis:// or rediss:// URL (got %q)", RedactURL(c.Redis.URL))
	}
	positive("redis.timeout", c.Redis.Timeout)

	oneOf("search.engine", c.Search.Engine, "elasticsearch", "opensearch")
	for _, raw := range strings.Split(c.Search.URL, ",") {
		if u, err := url.Parse(strings.TrimSpace(raw)); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("search.url", "must be a comma-separated list of http:// or https:// URLs (got %q)", RedactURL(raw))
		}
	}
	positive("search.timeout", c.Search.Timeout)
	if c.Search.Alias == "" || strings.ToLower(c.Search.Alias) != c.Search.Alias || strings.ContainsAny(c.Search.Alias, ` ,"*\/<>|?#`) {
		bad("search.alias", "must be a lowercase index name without spaces or , \" * \\ / < > | ? # (got %q)", c.Search.Alias)
	}
	oneOf("search.provision", c.Search.Provision, "auto", "verify", "off")
	between("search.bulk_size", int64(c.Search.BulkSize), 1, 10000)
	if c.Search.RefreshAfter < 0 || c.Search.RefreshAfter > time.Minute {
		bad("search.refresh_after", "must be between 0 (off) and 1m (got %s)", c.Search.RefreshAfter)
	}
	if c.Search.ReindexMaxFailures < 0 {
		bad("search.reindex_max_failures", "must be 0 or more (got %d)", c.Search.ReindexMaxFailures)
	}

	if c.HTTP.Addr != "" {
		if _, _, err := net.SplitHostPort(c.HTTP.Addr); err != nil {
			bad("http.addr", "must be host:port such as 0.0.0.0:9464, or empty to disable (got %q)", c.HTTP.Addr)
		}
	}
	for _, p := range strings.Split(c.HTTP.Peers, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if _, port, err := net.SplitHostPort(p); err != nil || port == "0" {
			bad("http.peers", "must be comma-separated host:port pairs such as relay:9464,searchindex:9464 (got %q)", p)
		}
	}

	oneOf("tracing.exporter", c.Tracing.Exporter, "none", "stdout", "otlp")
	if c.Tracing.OTLPEndpoint != "" {
		if u, err := url.Parse(c.Tracing.OTLPEndpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("tracing.otlp_endpoint", "must be an http:// or https:// URL such as http://otel-collector:4318/v1/traces (got %q)", RedactURL(c.Tracing.OTLPEndpoint))
		}
	}

	oneOf("log.level", c.Log.Level, "debug", "info", "warn", "error")
	oneOf("log.format", c.Log.Format, "auto", "json", "text")

	between("demo.rate", int64(c.Demo.Rate), 1, 100000)
	between("demo.products", int64(c.Demo.Products), 1, 10000000)
	positive("demo.progress_interval", c.Demo.ProgressInterval)

	errs = append(errs, c.crossKeyErrors()...)
	if len(errs) == 0 {
		// Each subscriber's own settings, once the shared ones hold.
		if err := c.validateOverrides(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// crossKeyErrors checks the settings that are each valid alone but cannot
// work together; each error names every key involved.
func (c *Config) crossKeyErrors() []error {
	var errs []error
	for _, rule := range crossKeyRules {
		if msg := rule.check(c); msg != "" {
			errs = append(errs, errors.New(msg))
		}
	}
	return errs
}

// CrossKeyRule is one rule tying keys together.
type CrossKeyRule struct {
	// Keys are every key the rule involves; its error names them all.
	Keys  []string
	check func(*Config) string
}

// CrossKeyRules lists the rules, for documentation and tests.
func CrossKeyRules() []CrossKeyRule { return crossKeyRules }

var crossKeyRules = []CrossKeyRule{
	{
		// A row whose publish JetStream stored but whose PubAck or mark was
		// lost is published again: after its lease expires and the reaper
		// returns it, or after its retry backoff. The second publish must
		// still fall inside the duplicates window, or the stream stores
		// the event twice.
		Keys: []string{"stream.duplicate_window", "relay.lease", "relay.publish_timeout", "relay.reap_interval", "relay.retry_max"},
		check: func(c *Config) string {
			if need := RepublishDelay(c.Relay); c.Stream.DuplicateWindow <= need {
				return fmt.Sprintf("stream.duplicate_window (%s) must be longer than relay.lease (%s) + relay.publish_timeout (%s) + relay.reap_interval (%s) + relay.retry_max (%s) = %s, the longest a row's second publish can follow its first; a shorter window lets the stream store an event twice",
					c.Stream.DuplicateWindow, c.Relay.Lease, c.Relay.PublishTimeout, c.Relay.ReapInterval, c.Relay.RetryMax, need)
			}
			return ""
		},
	},
	{
		// A cache fill that read a row before an invalidation may write it
		// after; the tombstone must outlive the slowest fill (a read and a
		// write, each bounded by redis.timeout).
		Keys: []string{"redis.tombstone_ttl", "redis.timeout"},
		check: func(c *Config) string {
			if c.Redis.TombstoneTTL <= 2*c.Redis.Timeout {
				return fmt.Sprintf("redis.tombstone_ttl (%s) must be longer than twice redis.timeout (%s), the longest a cache fill can take, or a stale fill could overwrite an invalidation", c.Redis.TombstoneTTL, c.Redis.Timeout)
			}
			return ""
		},
	},
	{
		// The stream's prefix and the dead letters' must differ: dead
		// letters would otherwise land in the events stream.
		Keys: []string{"subscribers.dead_letter_subject_prefix", "stream.subject_prefix"},
		check: func(c *Config) string {
			if c.Subscribers.DeadLetterSubjectPrefix == c.Stream.SubjectPrefix {
				return fmt.Sprintf("subscribers.dead_letter_subject_prefix (%q) must differ from stream.subject_prefix (%q): dead letters would be published as events", c.Subscribers.DeadLetterSubjectPrefix, c.Stream.SubjectPrefix)
			}
			return ""
		},
	},
	{
		Keys: []string{"subscribers.dead_letter_stream", "stream.name"},
		check: func(c *Config) string {
			if c.Subscribers.DeadLetterStream == c.Stream.Name {
				return fmt.Sprintf("subscribers.dead_letter_stream (%q) must differ from stream.name (%q)", c.Subscribers.DeadLetterStream, c.Stream.Name)
			}
			return ""
		},
	},
}

// DeadLetterDuplicateWindow is how long the dead-letter stream remembers a
// dead letter's id (see subscribers.DeadLetterDuplicateWindow).
const DeadLetterDuplicateWindow = subscribers.DeadLetterDuplicateWindow

// RepublishDelay is the longest a row's second publish can follow its
// first: a lost PubAck or mark leaves it to the reaper (lease, then up to a
// reap interval) or to its retry backoff (after the publish timeout, up to
// retry_max). The stream's duplicates window must be longer.
func RepublishDelay(r Relay) time.Duration { return relay.RepublishDelay(r) }
