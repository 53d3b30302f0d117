package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/opsserver"
	"github.com/fanout/fanout/internal/tracing"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/shop/demo"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
)

// writeConfig writes a YAML file for one test and returns its path.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fanout.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// Without a file or a variable, fanout runs with each package's defaults,
// so that an embedding program gets the same, and they are valid.
func TestDefaultsAreThePackagesDefaults(t *testing.T) {
	cfg, err := loadConfig("", nil, subscriberNames()...)
	if err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if fmt.Sprintf("%+v", *cfg) != fmt.Sprintf("%+v", defaultConfig()) {
		t.Errorf("loaded without a file or a variable:\n%+v\nwant the packages' defaults:\n%+v", *cfg, defaultConfig())
	}
	if cfg.Relay.BatchSize != relay.DefaultBatchSize || cfg.Relay.Lease != relay.DefaultLease || cfg.Stream.Name != "EVENTS" || cfg.Stream.Provision != "auto" {
		t.Errorf("defaults: %+v", cfg.Relay)
	}
}

// Every section validates itself, naming its keys; its defaults pass.
func TestEverySectionValidatesItself(t *testing.T) {
	if err := config.ValidateSections(Config{}); err == nil || strings.Contains(err.Error(), "has no Validate method") {
		t.Errorf("zero configuration: %v; want every section's own errors", err)
	}
	for _, c := range []struct {
		err  error
		want []string
	}{
		{connect.PostgresConfig{}.Validate(), []string{"postgres.url", "postgres.max_conns", "postgres.connect_timeout"}},
		{connect.NATSConfig{}.Validate(), []string{"nats.url", "nats.connect_timeout", "nats.request_timeout"}},
		{stream.Config{}.Validate(), []string{"stream.name", "stream.subject_prefix", "stream.replicas", "stream.provision"}},
		{relay.Config{}.Validate(), []string{"relay.batch_size", "relay.lease", "relay.poll_interval", "relay.stall_after"}},
		{subscribers.Config{}.Validate(), []string{"subscribers.concurrency", "subscribers.ack_wait", "subscribers.max_crashes", "subscribers.dead_letter_stream"}},
		{connect.RedisConfig{}.Validate(), []string{"redis.url", "redis.timeout", "redis.tombstone_ttl"}},
		{searchindex.Config{}.Validate(), []string{"search.engine", "search.url", "search.timeout", "search.alias", "search.bulk_size"}},
		{opsserver.Config{Addr: "nowhere", Peers: "relay"}.Validate(), []string{"http.addr", "http.peers"}},
		{tracing.Config{}.Validate(), []string{"tracing.exporter"}},
		{logging.Config{}.Validate(), []string{"log.level", "log.format"}},
		{demo.Config{}.Validate(), []string{"demo.rate", "demo.products", "demo.progress_interval"}},
	} {
		for _, key := range c.want {
			if c.err == nil || !strings.Contains(c.err.Error(), key+" ") {
				t.Errorf("zero settings: %v, want %s named", c.err, key)
			}
		}
	}
	if err := config.ValidateSections(defaultConfig()); err != nil {
		t.Errorf("defaults refused: %v", err)
	}
}

func TestPrecedenceDefaultsThenFileThenEnv(t *testing.T) {
	path := writeConfig(t, "relay:\n  batch_size: 200\n  lease: 3m\n  poll_interval: 250ms\nstream:\n  replicas: 3\n")
	cfg, err := loadConfig(path, []string{"FANOUT_RELAY_BATCH_SIZE=300", "FANOUT_RELAY_MAX_IN_FLIGHT=600", "HOME=/root"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Relay.BatchSize != 300 {
		t.Errorf("batch_size = %d, want the environment's 300 over the file's 200", cfg.Relay.BatchSize)
	}
	if cfg.Relay.MaxInFlight != 600 {
		t.Errorf("max_in_flight = %d, want 600 from FANOUT_RELAY_MAX_IN_FLIGHT (a key with underscores)", cfg.Relay.MaxInFlight)
	}
	if cfg.Relay.Lease != 3*time.Minute || cfg.Relay.PollInterval != 250*time.Millisecond || cfg.Stream.Replicas != 3 {
		t.Errorf("file values: lease %s poll %s replicas %d", cfg.Relay.Lease, cfg.Relay.PollInterval, cfg.Stream.Replicas)
	}
	if cfg.Relay.PublishTimeout != 10*time.Second {
		t.Errorf("publish_timeout = %s, want the default 10s", cfg.Relay.PublishTimeout)
	}
}

func TestErrorsNameTheKey(t *testing.T) {
	for _, tc := range []struct {
		env  []string
		yaml string
		want string
	}{
		{env: []string{"FANOUT_RELAY_BATCH_SIZE=0"}, want: "relay.batch_size must be between 1 and 10000 (got 0)"},
		{env: []string{"FANOUT_STREAM_PROVISION=sometimes"}, want: `stream.provision must be one of auto, verify, off (got "sometimes")`},
		{env: []string{"FANOUT_RELAY_LEASE=500ms"}, want: "relay.lease must be at least 1s"},
		{env: []string{"FANOUT_SUBSCRIBERS_MAX_DELIVER=5"}, want: `FANOUT_SUBSCRIBERS_MAX_DELIVER: config key "subscribers.max_deliver" is gone: replaced by subscribers.max_failures`},
		{yaml: "subscribers:\n  max_deliver: 5\n", want: `config key "subscribers.max_deliver" is gone: replaced by subscribers.max_failures`},
		{yaml: "http:\n  ready_max_pending_age: 1m\n", want: `config key "http.ready_max_pending_age" is gone: replaced by relay.stall_after`},
		{env: []string{"FANOUT_RELAY_BATCHSIZE=5"}, want: "FANOUT_RELAY_BATCHSIZE names no config key"},
		{env: []string{"FANOUT_POSTGRES_URL=mysql://x"}, want: "postgres.url must be a postgres:// URL"},
		{env: []string{"FANOUT_NATS_URL=http://x"}, want: "nats.url must be a comma-separated list of nats:// or tls:// URLs"},
		{env: []string{"FANOUT_REDIS_URL=http://x"}, want: "redis.url must be a redis:// or rediss:// URL"},
		{env: []string{"FANOUT_SEARCH_ALIAS=Products"}, want: "search.alias must be a lowercase index name"},
		{env: []string{"FANOUT_HTTP_PEERS=relay"}, want: "http.peers must be comma-separated host:port pairs"},
		{env: []string{"FANOUT_DEMO_RATE=0"}, want: "demo.rate must be between 1 and 100000 (got 0)"},
		{env: []string{"FANOUT_LOG_LEVEL=loud"}, want: "log.level must be one of debug, info, warn, error"},
		{env: []string{"FANOUT_RELAY_LEASE=soon"}, want: "relay.lease"},
		{yaml: "relay:\n  batchsize: 5\n", want: `unknown config key "relay.batchsize"`},
		{yaml: "stream:\n  name: my.events\n", want: "stream.name must be"},
		{env: []string{"FANOUT_TRACING_EXPORTER=jaeger"}, want: `tracing.exporter must be one of none, stdout, otlp (got "jaeger")`},
		{env: []string{"FANOUT_TRACING_EXPORTER=otlp", "FANOUT_TRACING_OTLP_ENDPOINT=otel-collector:4318"}, want: "tracing.otlp_endpoint must be an http:// or https:// URL"},
	} {
		path := ""
		if tc.yaml != "" {
			path = writeConfig(t, tc.yaml)
		}
		_, err := loadConfig(path, tc.env)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("loadConfig(%v %q) error = %v, want it to contain %q", tc.env, tc.yaml, err, tc.want)
		}
	}
}

func TestSecretFromFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(path, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"postgres.password", "nats.password", "nats.token", "redis.password", "search.password"} {
		cfg, err := loadConfig("", []string{config.EnvName(key+"_file") + "=" + path})
		if err != nil {
			t.Fatal(err)
		}
		section, name, _ := strings.Cut(key, ".")
		if got := cfg.Redacted()[section].(map[string]any)[name]; got != "<redacted>" {
			t.Errorf("%s from %s_file: %v, want it read (and redacted)", key, key, got)
		}
	}
	cfg, err := loadConfig("", []string{"FANOUT_POSTGRES_PASSWORD_FILE=" + path})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Postgres.Password != "s3cret" {
		t.Errorf("password from file = %q", cfg.Postgres.Password)
	}
	cfg, err = loadConfig("", []string{"FANOUT_POSTGRES_PASSWORD_FILE=" + path, "FANOUT_POSTGRES_PASSWORD=given"})
	if err != nil || cfg.Postgres.Password != "given" {
		t.Errorf("password given and a file: %q (%v), want the password given", cfg.Postgres.Password, err)
	}
	_, err = loadConfig("", []string{"FANOUT_NATS_TOKEN_FILE=/nonexistent/token"})
	if err == nil || !strings.Contains(err.Error(), "nats.token_file") {
		t.Errorf("missing secret file: %v, want an error naming nats.token_file", err)
	}
}

func TestEnvNamesAreUnambiguous(t *testing.T) {
	seen := map[string]string{}
	for _, k := range configKeys(subscriberNames()...) {
		if other, ok := seen[config.EnvName(k)]; ok {
			t.Errorf("%s and %s share the environment variable %s", k, other, config.EnvName(k))
		}
		seen[config.EnvName(k)] = k
	}
}

// fanout.example.yaml lists every key with its default: loading it changes
// nothing, and no key is missing from it.
func TestExampleFileHasEveryKeyAndItsDefault(t *testing.T) {
	path := filepath.Join("..", "..", "fanout.example.yaml")
	fromFile, err := loadConfig(path, nil)
	if err != nil {
		t.Fatalf("load %s: %v", path, err)
	}
	defaults, _ := loadConfig("", nil)
	if fmt.Sprint(fromFile.Redacted()) != fmt.Sprint(defaults.Redacted()) {
		t.Errorf("the example file's values differ from the defaults:\nfile:     %v\ndefaults: %v", fromFile.Redacted(), defaults.Redacted())
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range configKeys() {
		section, key, _ := strings.Cut(k, ".")
		if !strings.Contains(string(raw), "\n"+section+":\n") || !strings.Contains(string(raw), "\n  "+key+":") {
			t.Errorf("key %s is missing from fanout.example.yaml", k)
		}
	}
}

func TestRedactedHidesSecrets(t *testing.T) {
	cfg, err := loadConfig("", []string{
		"FANOUT_POSTGRES_PASSWORD=pg-s3cret", "FANOUT_NATS_URL=nats://relay:nats-s3cret@127.0.0.1:4222",
		"FANOUT_NATS_TOKEN=tok-s3cret", "FANOUT_SEARCH_PASSWORD=es-s3cret", "FANOUT_REDIS_URL=redis://:redis-s3cret@127.0.0.1:6379/0",
	})
	if err != nil {
		t.Fatal(err)
	}
	printed := fmt.Sprint(cfg.Redacted())
	if strings.Contains(printed, "s3cret") || !strings.Contains(printed, "<redacted>") {
		t.Errorf("redacted config shows a secret: %s", printed)
	}
}

// breaksAlone loads env and checks that exactly one error comes back,
// naming every one of keys.
func breaksAlone(t *testing.T, env []string, keys []string) {
	t.Helper()
	_, err := loadConfig("", env)
	if err == nil {
		t.Errorf("%v: accepted, want the rule over %v to refuse it", env, keys)
		return
	}
	for _, key := range keys {
		if !strings.Contains(err.Error(), key) {
			t.Errorf("%v: error %q does not name %s", env, err, key)
		}
	}
	// Only this rule: every other rule holds for these settings.
	if n := strings.Count(err.Error(), "\n") + 1; n != 1 {
		t.Errorf("%v: %d errors, want only the rule's own: %v", env, n, err)
	}
}

// TestCrossKeyRules breaks each rule that ties sections together, alone,
// and checks that the configuration is refused with an error naming every
// key involved; and that every rule has a case here.
func TestCrossKeyRules(t *testing.T) {
	cases := map[string][]string{ // the rule's first two keys -> variables that break it alone
		"stream.duplicate_window relay.lease":                          {"FANOUT_STREAM_DUPLICATE_WINDOW=7m"}, // 2m + 10s + 10s + 5m = 7m20s
		"subscribers.dead_letter_subject_prefix stream.subject_prefix": {"FANOUT_SUBSCRIBERS_DEAD_LETTER_SUBJECT_PREFIX=events"},
		"subscribers.dead_letter_stream stream.name":                   {"FANOUT_SUBSCRIBERS_DEAD_LETTER_STREAM=EVENTS"},
	}
	for _, rule := range crossKeyRules {
		sections := map[string]bool{}
		for _, key := range rule.keys {
			section, _, _ := strings.Cut(key, ".")
			sections[section] = true
		}
		if len(sections) < 2 {
			t.Errorf("rule over %v ties the keys of one section: it belongs in that section's Validate", rule.keys)
		}
		id := rule.keys[0] + " " + rule.keys[1]
		env, ok := cases[id]
		if !ok {
			t.Errorf("rule over %v has no case in this test", rule.keys)
			continue
		}
		delete(cases, id)
		breaksAlone(t, env, rule.keys)
	}
	for id := range cases {
		t.Errorf("case %q matches no rule", id)
	}
}

// The rules that tie keys of one section together are that section's
// Validate's: each, broken alone, is refused naming every key involved.
func TestSectionRules(t *testing.T) {
	for _, c := range []struct {
		env  []string
		keys []string
	}{
		{[]string{"FANOUT_RELAY_MAX_IN_FLIGHT=600", "FANOUT_RELAY_BATCH_SIZE=1000"}, []string{"relay.max_in_flight", "relay.batch_size"}},
		{[]string{"FANOUT_RELAY_LEASE=5s", "FANOUT_RELAY_PUBLISH_TIMEOUT=10s"}, []string{"relay.lease", "relay.publish_timeout"}},
		{[]string{"FANOUT_RELAY_STALL_AFTER=10s"}, []string{"relay.stall_after", "relay.publish_timeout", "relay.poll_interval"}},
		{[]string{"FANOUT_STREAM_MAX_AGE=5m", "FANOUT_STREAM_DUPLICATE_WINDOW=8m", "FANOUT_RELAY_RETRY_MAX=10s"}, []string{"stream.duplicate_window", "stream.max_age"}},
		{[]string{"FANOUT_SUBSCRIBERS_ACK_WAIT=30s", "FANOUT_SUBSCRIBERS_HANDLER_TIMEOUT=1m"}, []string{"subscribers.ack_wait", "subscribers.handler_timeout"}},
		{[]string{"FANOUT_SUBSCRIBERS_STALL_AFTER=30s"}, []string{"subscribers.stall_after", "subscribers.handler_timeout", "subscribers.retry_max"}}, // retry_max is 1m
		{[]string{"FANOUT_SUBSCRIBERS_DEAD_LETTER_MAX_AGE=5m"}, []string{"subscribers.dead_letter_max_age", "subscribers.ack_wait"}},
		{[]string{"FANOUT_SUBSCRIBERS_PINNED_TTL=30s"}, []string{"subscribers.pinned_ttl", "subscribers.ack_wait"}}, // ack_wait is 30s
		{[]string{"FANOUT_SUBSCRIBERS_GAP_WAIT=30s"}, []string{"subscribers.gap_wait", "subscribers.ack_wait"}},
		{[]string{"FANOUT_REDIS_TOMBSTONE_TTL=3s", "FANOUT_REDIS_TIMEOUT=2s"}, []string{"redis.tombstone_ttl", "redis.timeout"}},
		{[]string{"FANOUT_RELAY_ATOMIC=transaction", "FANOUT_RELAY_CAPTURE=wal", "FANOUT_RELAY_MAX_IN_FLIGHT=999", "FANOUT_RELAY_BATCH_SIZE=500"}, []string{"relay.max_in_flight", "relay.atomic"}},
		{[]string{"FANOUT_RELAY_ATOMIC=transaction", "FANOUT_RELAY_MAX_IN_FLIGHT=999", "FANOUT_RELAY_BATCH_SIZE=500"}, []string{"relay.max_in_flight", "relay.atomic"}},
	} {
		breaksAlone(t, c.env, c.keys)
	}
	// relay.New refuses this one with the same words (it calls Validate).
	_, err := loadConfig("", []string{"FANOUT_RELAY_MAX_IN_FLIGHT=600", "FANOUT_RELAY_BATCH_SIZE=1000"})
	const want = "relay.max_in_flight (600) must be at least relay.batch_size (1000): the relay claims a batch only when all of it fits in flight, so it would never publish"
	if err == nil || err.Error() != want {
		t.Errorf("max_in_flight below batch_size: %v, want %q", err, want)
	}
}

// A subscriber's own settings (subscribers.<name>.<key>, from the file or
// FANOUT_SUBSCRIBERS_<NAME>_<KEY>) override the shared ones for it alone.
func TestSubscriberOverrides(t *testing.T) {
	path := writeConfig(t, "subscribers:\n  batch_size: 50\n  searchindex:\n    batch_size: 500\n    concurrency: 8\n")
	names := []string{"invoicing", "searchindex", "cache_inval"}
	cfg, err := loadConfig(path, []string{"FANOUT_SUBSCRIBERS_INVOICING_ACK_WAIT=2m", "FANOUT_SUBSCRIBERS_INVOICING_HANDLER_TIMEOUT=90s",
		"FANOUT_SUBSCRIBERS_CACHE_INVAL_MAX_FAILURES=3"}, names...)
	if err != nil {
		t.Fatal(err)
	}
	inv, six, cin, other := cfg.Subscriber("invoicing"), cfg.Subscriber("searchindex"), cfg.Subscriber("cache_inval"), cfg.Subscriber("nobody")
	if inv.AckWait != 2*time.Minute || inv.HandlerTimeout != 90*time.Second || inv.BatchSize != 50 {
		t.Errorf("invoicing: ack wait %s, handler timeout %s, batch %d; want 2m, 90s and the shared 50", inv.AckWait, inv.HandlerTimeout, inv.BatchSize)
	}
	if six.BatchSize != 500 || six.Concurrency != 8 || six.AckWait != 30*time.Second {
		t.Errorf("searchindex: batch %d, concurrency %d, ack wait %s; want 500, 8 and the shared 30s", six.BatchSize, six.Concurrency, six.AckWait)
	}
	if cin.MaxFailures != 3 {
		t.Errorf("cache_inval (a name with an underscore): max failures %d, want 3", cin.MaxFailures)
	}
	if other != cfg.Subscribers || cfg.Subscribers.BatchSize != 50 || cfg.Subscribers.AckWait != 30*time.Second {
		t.Errorf("the shared settings changed: %+v", cfg.Subscribers)
	}
	printed := fmt.Sprint(cfg.Redacted()["subscribers"])
	if !strings.Contains(printed, "invoicing:map[ack_wait:2m0s") {
		t.Errorf("config print does not show invoicing's own settings: %s", printed)
	}
	cfg.SetSubscriberStart("new")
	if cfg.Subscriber("invoicing").Start != "new" || cfg.Subscriber("nobody").Start != "new" {
		t.Errorf("--start reaches every subscriber")
	}

	for _, c := range []struct {
		env   []string
		names []string
		want  string
	}{
		// Each subscriber's settings are checked as a whole, naming it.
		{[]string{"FANOUT_SUBSCRIBERS_INVOICING_HANDLER_TIMEOUT=40s"}, names,
			"with the subscribers.invoicing.* settings: subscribers.handler_timeout (40s) must be shorter than subscribers.ack_wait (30s)"},
		{[]string{"FANOUT_SUBSCRIBERS_SEARCHINDEX_BATCH_SIZE=0"}, names,
			"with the subscribers.searchindex.* settings: subscribers.batch_size must be between 1 and 1000 (got 0)"},
		// ... shared keys and its own together.
		{[]string{"FANOUT_SUBSCRIBERS_DEAD_LETTER_MAX_AGE=30m", "FANOUT_SUBSCRIBERS_INVOICING_ACK_WAIT=20m"}, names,
			"with the subscribers.invoicing.* settings: subscribers.dead_letter_max_age (30m0s) must be at least 10m0s, the dead letters' duplicates window, and more than twice subscribers.ack_wait (20m0s)"},
		// Only the runtime's keys, and only for subscribers fanout knows.
		{[]string{"FANOUT_SUBSCRIBERS_NOBODY_ACK_WAIT=1m"}, names, "FANOUT_SUBSCRIBERS_NOBODY_ACK_WAIT names no config key"},
		{[]string{"FANOUT_SUBSCRIBERS_INVOICING_DEAD_LETTER_STREAM=X"}, names, "names no config key"},
		{[]string{"FANOUT_SUBSCRIBERS_INVOICING_ACK_WAIT=1m"}, nil, "names no config key"},
		// A name that would collide with a shared key.
		{nil, []string{"start"}, `subscriber name "start" is a subscribers.* key`},
	} {
		_, err := loadConfig("", c.env, c.names...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error containing %q", c.env, err, c.want)
		}
	}
}

// Section hands a subscriber the settings of a service it uses, into its
// own view of them or the section's own type.
func TestSection(t *testing.T) {
	cfg, err := loadConfig("", []string{"FANOUT_REDIS_TIMEOUT=3s", "FANOUT_SEARCH_ALIAS=items"})
	if err != nil {
		t.Fatal(err)
	}
	var redis struct {
		Timeout      time.Duration `koanf:"timeout"`
		TombstoneTTL time.Duration `koanf:"tombstone_ttl"`
	}
	if err := cfg.Section("redis", &redis); err != nil || redis.Timeout != 3*time.Second || redis.TombstoneTTL != 10*time.Second {
		t.Errorf("redis section: %+v (%v)", redis, err)
	}
	var search searchindex.Config
	if err := cfg.Section("search", &search); err != nil || search.Alias != "items" || search.BulkSize != 1000 {
		t.Errorf("search section: %+v (%v)", search, err)
	}
	if err := cfg.Section("nosuch", &redis); err == nil {
		t.Error("an unknown section was read")
	}
}

// Every way a secret can be given is hidden by `config print` (Redacted),
// with what was masked still visible as masked.
func TestRedactedHidesEveryForm(t *testing.T) {
	dir := t.TempDir()
	file := dir + "/secret"
	if err := os.WriteFile(file, []byte("file-s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadConfig("", []string{
		"FANOUT_POSTGRES_URL=postgres://fanout:pg-s3cret@127.0.0.1:5432/fanout?sslmode=disable&password=pgq-s3cret&sslpassword=pgs-s3cret",
		"FANOUT_POSTGRES_PASSWORD_FILE=" + file,
		"FANOUT_NATS_URL=nats://tok-s3cret@127.0.0.1:4222,nats://relay:nats-s3cret@127.0.0.1:4223",
		"FANOUT_NATS_USER=relay", "FANOUT_NATS_PASSWORD=natsp-s3cret", "FANOUT_NATS_TOKEN=natst-s3cret",
		"FANOUT_REDIS_URL=redis://cache:redis-s3cret@127.0.0.1:6379/0", "FANOUT_REDIS_PASSWORD=redisp-s3cret",
		"FANOUT_SEARCH_URL=http://elastic:es-s3cret@127.0.0.1:9200", "FANOUT_SEARCH_USERNAME=elastic", "FANOUT_SEARCH_PASSWORD=esp-s3cret",
		"FANOUT_TRACING_EXPORTER=otlp", "FANOUT_TRACING_OTLP_ENDPOINT=https://otel:otlp-s3cret@collector:4318/v1/traces?api_key=otlpq-s3cret",
	})
	if err != nil {
		t.Fatal(err)
	}
	printed := fmt.Sprint(cfg.Redacted())
	if strings.Contains(printed, "s3cret") {
		t.Errorf("redacted config shows a secret: %s", printed)
	}
	for _, want := range []string{
		"postgres://fanout:xxxxx@127.0.0.1:5432/fanout?sslmode=disable&password=xxxxx&sslpassword=xxxxx",
		"nats://xxxxx@127.0.0.1:4222,nats://relay:xxxxx@127.0.0.1:4223",
		"redis://cache:xxxxx@127.0.0.1:6379/0", "http://elastic:xxxxx@127.0.0.1:9200",
		"https://otel:xxxxx@collector:4318/v1/traces?api_key=xxxxx",
		"password:<redacted>", "token:<redacted>", "password_file:" + file, "username:elastic", "user:relay",
	} {
		if !strings.Contains(printed, want) {
			t.Errorf("redacted config does not show %q: %s", want, printed)
		}
	}
}
