package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
)

func TestDefaultsAreValid(t *testing.T) {
	cfg, err := Load("", nil)
	if err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if cfg.Relay.BatchSize != DefaultBatchSize || cfg.Relay.Lease != DefaultLease || cfg.Stream.Name != "EVENTS" || cfg.Stream.Provision != "auto" {
		t.Errorf("defaults: %+v", cfg.Relay)
	}
}

func TestPrecedenceDefaultsThenFileThenEnv(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fanout.yaml")
	yaml := "relay:\n  batch_size: 200\n  lease: 3m\n  poll_interval: 250ms\nstream:\n  replicas: 3\n"
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := Load(path, []string{"FANOUT_RELAY_BATCH_SIZE=300", "FANOUT_RELAY_MAX_IN_FLIGHT=600", "HOME=/root"})
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
		{env: []string{"FANOUT_RELAY_BATCHSIZE=5"}, want: "FANOUT_RELAY_BATCHSIZE names no config key"},
		{env: []string{"FANOUT_POSTGRES_URL=mysql://x"}, want: "postgres.url must be a postgres:// URL"},
		{env: []string{"FANOUT_LOG_LEVEL=loud"}, want: "log.level must be one of debug, info, warn, error"},
		{env: []string{"FANOUT_RELAY_LEASE=soon"}, want: "relay.lease"},
		{yaml: "relay:\n  batchsize: 5\n", want: `unknown config key "relay.batchsize"`},
		{yaml: "stream:\n  name: my.events\n", want: "stream.name must be"},
		{env: []string{"FANOUT_TRACING_EXPORTER=jaeger"}, want: `tracing.exporter must be one of none, stdout, otlp (got "jaeger")`},
		{env: []string{"FANOUT_TRACING_EXPORTER=otlp", "FANOUT_TRACING_OTLP_ENDPOINT=otel-collector:4318"}, want: "tracing.otlp_endpoint must be an http:// or https:// URL"},
	} {
		path := ""
		if tc.yaml != "" {
			path = filepath.Join(t.TempDir(), "c.yaml")
			if err := os.WriteFile(path, []byte(tc.yaml), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		_, err := Load(path, tc.env)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Load(%v %q) error = %v, want it to contain %q", tc.env, tc.yaml, err, tc.want)
		}
	}
}

func TestSecretFromFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(path, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := Load("", []string{"FANOUT_POSTGRES_PASSWORD_FILE=" + path})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Postgres.Password != "s3cret" {
		t.Errorf("password from file = %q", cfg.Postgres.Password)
	}
	_, err = Load("", []string{"FANOUT_NATS_TOKEN_FILE=/nonexistent/token"})
	if err == nil || !strings.Contains(err.Error(), "nats.token_file") {
		t.Errorf("missing secret file: %v, want an error naming nats.token_file", err)
	}
}

func TestEnvNamesAreUnambiguous(t *testing.T) {
	seen := map[string]string{}
	for _, k := range Keys() {
		if other, ok := seen[EnvName(k)]; ok {
			t.Errorf("%s and %s share the environment variable %s", k, other, EnvName(k))
		}
		seen[EnvName(k)] = k
	}
}

// fanout.example.yaml lists every key with its default: loading it changes
// nothing, and no key is missing from it.
func TestExampleFileHasEveryKeyAndItsDefault(t *testing.T) {
	path := filepath.Join("..", "..", "fanout.example.yaml")
	fromFile, err := Load(path, nil)
	if err != nil {
		t.Fatalf("load %s: %v", path, err)
	}
	defaults, _ := Load("", nil)
	if fmt.Sprint(fromFile.Redacted()) != fmt.Sprint(defaults.Redacted()) {
		t.Errorf("the example file's values differ from the defaults:\nfile:     %v\ndefaults: %v", fromFile.Redacted(), defaults.Redacted())
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range Keys() {
		section, key, _ := strings.Cut(k, ".")
		if !strings.Contains(string(raw), "\n"+section+":\n") || !strings.Contains(string(raw), "\n  "+key+":") {
			t.Errorf("key %s is missing from fanout.example.yaml", k)
		}
	}
}

func TestRedactedHidesSecrets(t *testing.T) {
	cfg, err := Load("", []string{
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

// TestCrossKeyRules breaks each rule that ties keys together, alone, and
// checks that the configuration is refused with an error naming every key
// involved; and that every rule has a case here.
func TestCrossKeyRules(t *testing.T) {
	cases := map[string][]string{ // the rule's first two keys -> variables that break it alone
		"stream.duplicate_window relay.lease":                          {"FANOUT_STREAM_DUPLICATE_WINDOW=7m"}, // 2m + 10s + 10s + 5m = 7m20s
		"redis.tombstone_ttl redis.timeout":                            {"FANOUT_REDIS_TOMBSTONE_TTL=3s", "FANOUT_REDIS_TIMEOUT=2s"},
		"subscribers.dead_letter_subject_prefix stream.subject_prefix": {"FANOUT_SUBSCRIBERS_DEAD_LETTER_SUBJECT_PREFIX=events"},
		"subscribers.dead_letter_stream stream.name":                   {"FANOUT_SUBSCRIBERS_DEAD_LETTER_STREAM=EVENTS"},
	}
	for _, rule := range CrossKeyRules() {
		id := rule.Keys[0] + " " + rule.Keys[1]
		env, ok := cases[id]
		if !ok {
			t.Errorf("rule over %v has no case in this test", rule.Keys)
			continue
		}
		delete(cases, id)
		_, err := Load("", env)
		if err == nil {
			t.Errorf("%v: accepted, want the rule over %v to refuse it", env, rule.Keys)
			continue
		}
		for _, key := range rule.Keys {
			if !strings.Contains(err.Error(), key) {
				t.Errorf("%v: error %q does not name %s", env, err, key)
			}
		}
		// Only this rule: every other rule holds for these settings.
		if n := strings.Count(err.Error(), "\n") + 1; n != 1 {
			t.Errorf("%v: %d errors, want only the rule's own: %v", env, n, err)
		}
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
	} {
		_, err := Load("", c.env)
		if err == nil {
			t.Errorf("%v: accepted, want the rule over %v to refuse it", c.env, c.keys)
			continue
		}
		for _, key := range c.keys {
			if !strings.Contains(err.Error(), key) {
				t.Errorf("%v: error %q does not name %s", c.env, err, key)
			}
		}
		if n := strings.Count(err.Error(), "\n") + 1; n != 1 {
			t.Errorf("%v: %d errors, want only the rule's own: %v", c.env, n, err)
		}
	}
}

// A subscriber's own settings (subscribers.<name>.<key>, from the file or
// FANOUT_SUBSCRIBERS_<NAME>_<KEY>) override the shared ones for it alone.
func TestSubscriberOverrides(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fanout.yaml")
	yaml := "subscribers:\n  batch_size: 50\n  searchindex:\n    batch_size: 500\n    concurrency: 8\n"
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	names := WithSubscribers("invoicing", "searchindex", "cache_inval")
	cfg, err := Load(path, []string{"FANOUT_SUBSCRIBERS_INVOICING_ACK_WAIT=2m", "FANOUT_SUBSCRIBERS_INVOICING_HANDLER_TIMEOUT=90s",
		"FANOUT_SUBSCRIBERS_CACHE_INVAL_MAX_FAILURES=3"}, names)
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
		env  []string
		opts []LoadOption
		want string
	}{
		// Each subscriber's settings are checked as a whole, naming it.
		{[]string{"FANOUT_SUBSCRIBERS_INVOICING_HANDLER_TIMEOUT=40s"}, []LoadOption{names},
			"with the subscribers.invoicing.* settings: subscribers.handler_timeout (40s) must be shorter than subscribers.ack_wait (30s)"},
		{[]string{"FANOUT_SUBSCRIBERS_SEARCHINDEX_BATCH_SIZE=0"}, []LoadOption{names},
			"with the subscribers.searchindex.* settings: subscribers.batch_size must be between 1 and 1000 (got 0)"},
		// Only the runtime's keys, and only for subscribers fanout knows.
		{[]string{"FANOUT_SUBSCRIBERS_NOBODY_ACK_WAIT=1m"}, []LoadOption{names}, "FANOUT_SUBSCRIBERS_NOBODY_ACK_WAIT names no config key"},
		{[]string{"FANOUT_SUBSCRIBERS_INVOICING_DEAD_LETTER_STREAM=X"}, []LoadOption{names}, "names no config key"},
		{[]string{"FANOUT_SUBSCRIBERS_INVOICING_ACK_WAIT=1m"}, nil, "names no config key"},
		// A name that would collide with a shared key.
		{nil, []LoadOption{WithSubscribers("start")}, `subscriber name "start" is a subscribers.* key`},
	} {
		_, err := Load("", c.env, c.opts...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error containing %q", c.env, err, c.want)
		}
	}
}

// The packages own their settings' defaults: what Load gives without a file
// or a variable is what they say, so an embedding program gets the same.
func TestPackageDefaultsAreTheDefaults(t *testing.T) {
	cfg, err := Load("", nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Relay != relay.DefaultConfig() {
		t.Errorf("relay: loaded %+v, relay.DefaultConfig %+v", cfg.Relay, relay.DefaultConfig())
	}
	if cfg.Stream != stream.DefaultConfig() {
		t.Errorf("stream: loaded %+v, relay.DefaultStreamConfig %+v", cfg.Stream, stream.DefaultConfig())
	}
	if cfg.Subscribers != subscribers.DefaultConfig() {
		t.Errorf("subscribers: loaded %+v, subscribers.DefaultConfig %+v", cfg.Subscribers, subscribers.DefaultConfig())
	}
	if cfg.Search != searchindex.DefaultConfig() {
		t.Errorf("search: loaded %+v, searchindex.DefaultConfig %+v", cfg.Search, searchindex.DefaultConfig())
	}
	// Each package's Validate names its keys.
	for _, c := range []struct {
		err  error
		want []string
	}{
		{relay.Config{}.Validate(), []string{"relay.batch_size", "relay.lease", "relay.poll_interval", "relay.stall_after"}},
		{stream.Config{}.Validate(), []string{"stream.name", "stream.subject_prefix", "stream.replicas", "stream.provision"}},
		{subscribers.Config{}.Validate(), []string{"subscribers.concurrency", "subscribers.ack_wait", "subscribers.max_crashes", "subscribers.dead_letter_stream"}},
	} {
		for _, key := range c.want {
			if c.err == nil || !strings.Contains(c.err.Error(), key+" ") {
				t.Errorf("zero settings: %v, want %s named", c.err, key)
			}
		}
	}
	for _, err := range []error{relay.DefaultConfig().Validate(), stream.DefaultConfig().Validate(), subscribers.DefaultConfig().Validate()} {
		if err != nil {
			t.Errorf("defaults refused: %v", err)
		}
	}
}

// Section hands a subscriber the settings of a service it uses, into its
// own view of them or the section's own type.
func TestSection(t *testing.T) {
	cfg, err := Load("", []string{"FANOUT_REDIS_TIMEOUT=3s", "FANOUT_SEARCH_ALIAS=items"})
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
	var search Search
	if err := cfg.Section("search", &search); err != nil || search.Alias != "items" || search.BulkSize != 1000 {
		t.Errorf("search section: %+v (%v)", search, err)
	}
	if err := cfg.Section("nosuch", &redis); err == nil {
		t.Error("an unknown section was read")
	}
}
