package config_test

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/validate"
)

// server and worker are two sections of a configuration of this test's
// own: package config knows no setting.
type server struct {
	// Addr is host:port. Default "127.0.0.1:80".
	Addr string `koanf:"addr"`
	// Password authenticates; PasswordFile holds it. Secret.
	Password     string        `koanf:"password"`
	PasswordFile string        `koanf:"password_file"`
	Timeout      time.Duration `koanf:"timeout"`
	MaxConns     int32         `koanf:"max_conns"`
	Verify       bool          `koanf:"verify"`
}

func (s server) Validate() error {
	var v validate.Errors
	v.Positive("server.timeout", s.Timeout)
	return v.Err()
}

type worker struct {
	BatchSize int           `koanf:"batch_size"`
	AckWait   time.Duration `koanf:"ack_wait"`
	Queue     string        `koanf:"queue"`
}

func (w worker) Validate() error {
	var v validate.Errors
	v.Between("worker.batch_size", int64(w.BatchSize), 1, 100)
	return v.Err()
}

type testConfig struct {
	Server server `koanf:"server"`
	Worker worker `koanf:"worker"`

	each map[string]worker
}

func defaults() *testConfig {
	return &testConfig{
		Server: server{Addr: "127.0.0.1:80", Timeout: 5 * time.Second, MaxConns: 10, Verify: true},
		Worker: worker{BatchSize: 10, AckWait: 30 * time.Second, Queue: "jobs"},
	}
}

// Validate: the sections, then a rule across them, then each worker's own.
func (c *testConfig) Validate() error {
	if err := config.ValidateSections(c); err != nil {
		return err
	}
	if c.Worker.AckWait <= c.Server.Timeout {
		return fmt.Errorf("worker.ack_wait (%s) must be longer than server.timeout (%s)", c.Worker.AckWait, c.Server.Timeout)
	}
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(c.each)) {
		one := *c
		one.Worker, one.each = c.each[name], nil
		if err := one.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("with the worker.%s.* settings: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

var replaced = map[string]string{"worker.max_retries": "replaced by worker.ack_wait"}

func perWorker(c *testConfig, names ...string) config.PerName[worker] {
	return config.PerName[worker]{Section: "worker", Noun: "worker", Keys: []string{"batch_size", "ack_wait"}, Names: names, Into: &c.each}
}

func load(t *testing.T, yaml string, env []string, names ...string) (*testConfig, error) {
	t.Helper()
	path := ""
	if yaml != "" {
		path = filepath.Join(t.TempDir(), "c.yaml")
		if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	c := defaults()
	err := config.Load(c, path, env, config.Replaced(replaced), perWorker(c, names...))
	return c, err
}

// The keys are the fields: their koanf tags, under their section's.
func TestKeysAreTheFields(t *testing.T) {
	want := []string{"server.addr", "server.max_conns", "server.password", "server.password_file", "server.timeout", "server.verify",
		"worker.ack_wait", "worker.batch_size", "worker.queue"}
	if got := config.Keys(defaults()); !slices.Equal(got, want) {
		t.Errorf("Keys = %v, want %v", got, want)
	}
	if got, want := perWorker(defaults(), "a", "b").AllKeys(), []string{"worker.a.ack_wait", "worker.a.batch_size", "worker.b.ack_wait", "worker.b.batch_size"}; !slices.Equal(got, want) {
		t.Errorf("AllKeys = %v, want %v", got, want)
	}
}

// The values the configuration holds are the defaults; the file overrides
// them, and the environment the file.
func TestPrecedenceDefaultsThenFileThenEnv(t *testing.T) {
	c, err := load(t, "server:\n  timeout: 3s\n  max_conns: 20\nworker:\n  batch_size: 50\n  queue: file\n",
		[]string{"FANOUT_WORKER_BATCH_SIZE=60", "FANOUT_SERVER_VERIFY=false", "HOME=/root", "FANOUT_CONFIG=x.yaml", "FANOUT_TEST_X=1"})
	if err != nil {
		t.Fatal(err)
	}
	want := testConfig{
		Server: server{Addr: "127.0.0.1:80", Timeout: 3 * time.Second, MaxConns: 20, Verify: false},
		Worker: worker{BatchSize: 60, AckWait: 30 * time.Second, Queue: "file"},
	}
	if fmt.Sprintf("%+v", *c) != fmt.Sprintf("%+v", want) {
		t.Errorf("loaded %+v, want %+v", *c, want)
	}
}

func TestRefusals(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		env  []string
		want string
	}{
		{env: []string{"FANOUT_WORKER_BATCHSIZE=5"}, want: "environment variable FANOUT_WORKER_BATCHSIZE names no config key (see `fanout config keys`)"},
		{yaml: "worker:\n  batchsize: 5\n", want: `unknown config key "worker.batchsize"`},
		{yaml: "worker: 5\n", want: `unknown config key "worker"`},
		{env: []string{"FANOUT_WORKER_MAX_RETRIES=5"}, want: `environment variable FANOUT_WORKER_MAX_RETRIES: config key "worker.max_retries" is gone: replaced by worker.ack_wait`},
		{yaml: "worker:\n  max_retries: 5\n", want: `config key "worker.max_retries" is gone: replaced by worker.ack_wait`},
		{env: []string{"FANOUT_SERVER_TIMEOUT=soon"}, want: "decode config"},
		{env: []string{"FANOUT_SERVER_TIMEOUT=0s", "FANOUT_WORKER_BATCH_SIZE=0"}, want: "server.timeout must be a positive duration such as 5s (got 0s)\nworker.batch_size must be between 1 and 100 (got 0)"},
		{env: []string{"FANOUT_WORKER_ACK_WAIT=1s"}, want: "worker.ack_wait (1s) must be longer than server.timeout (5s)"},
		{yaml: "server: [", want: "read config file"},
	} {
		_, err := load(t, tc.yaml, tc.env)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q %v: %v, want an error containing %q", tc.yaml, tc.env, err, tc.want)
		}
	}
}

// A string key X_file beside a key X is read into X, unless X is set.
func TestSecretFiles(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(path, []byte("s3cret\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := load(t, "", []string{"FANOUT_SERVER_PASSWORD_FILE=" + path})
	if err != nil || c.Server.Password != "s3cret" {
		t.Errorf("password from its file: %q (%v)", c.Server.Password, err)
	}
	c, err = load(t, "", []string{"FANOUT_SERVER_PASSWORD_FILE=" + path, "FANOUT_SERVER_PASSWORD=given"})
	if err != nil || c.Server.Password != "given" {
		t.Errorf("password given and a file: %q (%v), want the one given", c.Server.Password, err)
	}
	_, err = load(t, "", []string{"FANOUT_SERVER_PASSWORD_FILE=/nonexistent/pw"})
	if err == nil || !strings.HasPrefix(err.Error(), "server.password_file: ") {
		t.Errorf("a missing file: %v, want an error naming server.password_file", err)
	}
}

// Each name sets its own keys over the shared ones; its settings are
// checked as a whole.
func TestPerName(t *testing.T) {
	c, err := load(t, "worker:\n  batch_size: 20\n  fast:\n    batch_size: 90\n", []string{"FANOUT_WORKER_SLOW_POKE_ACK_WAIT=1m"}, "fast", "slow_poke", "idle")
	if err != nil {
		t.Fatal(err)
	}
	if got := c.each["fast"]; got.BatchSize != 90 || got.AckWait != 30*time.Second || got.Queue != "jobs" {
		t.Errorf("fast: %+v, want its batch size over the shared settings", got)
	}
	if got := c.each["slow_poke"]; got.BatchSize != 20 || got.AckWait != time.Minute {
		t.Errorf("slow_poke: %+v, want its ack wait over the shared settings", got)
	}
	if _, ok := c.each["idle"]; ok || len(c.each) != 2 {
		t.Errorf("settings for a name that sets none: %v", c.each)
	}
	for _, tc := range []struct {
		env   []string
		names []string
		want  string
	}{
		{[]string{"FANOUT_WORKER_FAST_BATCH_SIZE=0"}, []string{"fast"}, "with the worker.fast.* settings: worker.batch_size must be between 1 and 100 (got 0)"},
		{[]string{"FANOUT_WORKER_FAST_QUEUE=x"}, []string{"fast"}, "FANOUT_WORKER_FAST_QUEUE names no config key"},
		{[]string{"FANOUT_WORKER_FAST_BATCH_SIZE=5"}, nil, "FANOUT_WORKER_FAST_BATCH_SIZE names no config key"},
		{nil, []string{"queue"}, `worker name "queue" is a worker.* key: its settings would collide with it`},
		{nil, []string{"a.b"}, `worker name "a.b" cannot carry settings (worker.<name>.<key>)`},
	} {
		_, err := load(t, "", tc.env, tc.names...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v %v: %v, want an error containing %q", tc.env, tc.names, err, tc.want)
		}
	}
	c = defaults()
	bad := config.PerName[worker]{Section: "worker", Noun: "worker", Keys: []string{"speed"}, Into: &c.each}
	if err := config.Load(c, "", nil, bad); err == nil || !strings.Contains(err.Error(), "worker.speed is no key") {
		t.Errorf("a key the section lacks: %v", err)
	}
}

// Section reads a section into its own type or a view of some keys.
func TestSection(t *testing.T) {
	c := defaults()
	var view struct {
		Timeout time.Duration `koanf:"timeout"`
	}
	if err := config.Section(c, "server", &view); err != nil || view.Timeout != 5*time.Second {
		t.Errorf("a view: %+v (%v)", view, err)
	}
	var w worker
	if err := config.Section(*c, "worker", &w); err != nil || w != c.Worker {
		t.Errorf("the section's type: %+v (%v)", w, err)
	}
	if err := config.Section(c, "nosuch", &w); err == nil {
		t.Error("an unknown section was read")
	}
	if err := config.Section(c, "worker", w); err == nil {
		t.Error("read into a value, not a pointer")
	}
}

func TestRedacted(t *testing.T) {
	c := defaults()
	c.Server.Password, c.Server.PasswordFile = "s3cret", "/run/secrets/pw"
	got := fmt.Sprint(config.Redacted(c))
	want := "map[server:map[addr:127.0.0.1:80 max_conns:10 password:<redacted> password_file:/run/secrets/pw timeout:5s verify:true] " +
		"worker:map[ack_wait:30s batch_size:10 queue:jobs]]"
	if got != want {
		t.Errorf("Redacted = %s, want %s", got, want)
	}
}

// A section without a Validate method is a mistake ValidateSections
// reports rather than skips.
func TestSectionWithoutValidate(t *testing.T) {
	var c struct {
		Server server `koanf:"server"`
		Other  struct {
			X int `koanf:"x"`
		} `koanf:"other"`
	}
	c.Server = defaults().Server
	if err := config.ValidateSections(c); err == nil || !strings.Contains(err.Error(), "config section other") {
		t.Errorf("ValidateSections = %v, want section other named", err)
	}
}
