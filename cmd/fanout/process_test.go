package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/natstest"
	"github.com/fanout/fanout/internal/pgtest"
	"github.com/fanout/fanout/internal/redistest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "fanout-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "fanout")
	if out, err := exec.Command("go", "build", "-race", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build fanout: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// process is one running fanout role.
type process struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  bytes.Buffer
	done chan error
}

func (p *process) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.Write(b)
}

func (p *process) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// start runs `fanout args...` with the given FANOUT_ settings (and none from
// the test's own environment).
func start(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	p := &process{name: strings.Join(args, " "), done: make(chan error, 1)}
	p.cmd = exec.Command(binary, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FANOUT_") {
			p.cmd.Env = append(p.cmd.Env, kv)
		}
	}
	p.cmd.Env = append(p.cmd.Env, env...)
	p.cmd.Stdout, p.cmd.Stderr = p, p
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("output of fanout %s:\n%s", p.name, p.output())
		}
	})
	return p
}

// terminate sends SIGTERM and returns the exit error.
func (p *process) terminate(t *testing.T, within time.Duration) error {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.done:
		p.done <- err // for the cleanup
		return err
	case <-time.After(within):
		t.Fatalf("fanout %s did not exit within %s of SIGTERM", p.name, within)
		return nil
	}
}

// logLine is the part of a JSON log line the tests read.
type logLine struct {
	Msg        string `json:"msg"`
	Addr       string `json:"addr"`
	Subscriber string `json:"subscriber"`
	Events     int    `json:"events"`
}

// logLines returns the process's JSON log lines so far.
func (p *process) logLines() []logLine {
	var lines []logLine
	sc := bufio.NewScanner(strings.NewReader(p.output()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var line logLine
		if json.Unmarshal(sc.Bytes(), &line) == nil {
			lines = append(lines, line)
		}
	}
	return lines
}

// opsAddr waits for the process's "operations endpoint listening" line and
// returns the address.
func (p *process) opsAddr(t *testing.T) string {
	t.Helper()
	var addr string
	subscribertest.WaitFor(t, 20*time.Second, "the operations endpoint of "+p.name, func() (bool, string) {
		for _, line := range p.logLines() {
			if line.Msg == "operations endpoint listening" {
				addr = line.Addr
				return true, ""
			}
		}
		return false, ""
	})
	return addr
}

// get fetches a path of the process's operations endpoint.
func get(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	res, err := c.Get("http://" + addr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// waitStarted waits until the process logged that subscriber's start (its
// consumer exists and it is pulling).
func (p *process) waitStarted(t *testing.T, subscriber string) {
	t.Helper()
	subscribertest.WaitFor(t, 30*time.Second, subscriber+" started in "+p.name, func() (bool, string) {
		for _, line := range p.logLines() {
			if line.Msg == "subscriber started" && line.Subscriber == subscriber {
				return true, ""
			}
		}
		return false, ""
	})
}

// handled sums the events a process's "batch handled" log lines report
// for a subscriber.
func (p *process) handled(subscriber string) int {
	n := 0
	for _, line := range p.logLines() {
		if line.Msg == "batch handled" && line.Subscriber == subscriber {
			n += line.Events
		}
	}
	return n
}

// `fanout subscribe invoicing cacheinval` runs both in one process; a second
// `fanout subscribe invoicing` shares the invoicing work; SIGTERM drains all.
func TestSubscribeProcessesShareWork(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	redis := redistest.Start(t)
	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL,
		"FANOUT_NATS_URL=" + nats.URL,
		"FANOUT_REDIS_URL=" + redis.URL,
		"FANOUT_LOG_FORMAT=json",
		"FANOUT_LOG_LEVEL=debug",
		"FANOUT_RELAY_POLL_INTERVAL=50ms",
		"FANOUT_SUBSCRIBERS_BATCH_SIZE=10",
		"FANOUT_HTTP_ADDR=127.0.0.1:0",
	}
	relayProc := start(t, env, "relay")
	both := start(t, env, "subscribe", "invoicing", "cacheinval")
	one := start(t, env, "subscribe", "invoicing")
	// Both invoicing instances pull before the orders are written, or the
	// first one up could take them all.
	both.waitStarted(t, "invoicing")
	one.waitStarted(t, "invoicing")

	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 20, rand.New(rand.NewPCG(5, 5))); err != nil {
		t.Fatal(err)
	}
	const orders = 300
	for range orders / 10 {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			for range 10 {
				var pid int64
				if err := tx.QueryRow(ctx, `SELECT id FROM products ORDER BY random() LIMIT 1`).Scan(&pid); err != nil {
					return err
				}
				if _, _, err := shop.CreateOrder(ctx, tx, "cli", []shop.OrderLine{{ProductID: pid, Quantity: 1}}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	subscribertest.WaitFor(t, 60*time.Second, "every order invoiced", func() (bool, string) {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&n)
		return n == orders, fmt.Sprintf("%d invoices", n)
	})
	subscribertest.WaitFor(t, 30*time.Second, "the seed's product events invalidated", func() (bool, string) {
		n := both.handled("cacheinval")
		return n >= 20, fmt.Sprintf("%d handled", n)
	})
	// The operations endpoints: metrics and readiness of each role.
	if code, body := get(t, relayProc.opsAddr(t), "/metrics"); code != 200 || !strings.Contains(body, "fanout_relay_published_rows_total") ||
		!strings.Contains(body, "fanout_outbox_backlog_rows 0") {
		t.Errorf("relay /metrics: %d\n%.2000s", code, body)
	}
	bothAddr := both.opsAddr(t)
	if code, body := get(t, bothAddr, "/metrics"); code != 200 || !strings.Contains(body, `fanout_subscriber_handled_events_total{subscriber="cacheinval"}`) ||
		!strings.Contains(body, `fanout_subscriber_pending_events{subscriber="invoicing"} 0`) {
		t.Errorf("subscriber /metrics: %d\n%.3000s", code, body)
	}
	if code, body := get(t, bothAddr, "/readyz"); code != 200 || !strings.Contains(body, `"ready":true`) {
		t.Errorf("subscriber /readyz: %d %s", code, body)
	}
	if code, _ := get(t, bothAddr, "/livez"); code != 200 {
		t.Errorf("subscriber /livez: %d", code)
	}
	for _, p := range []*process{one, both, relayProc} {
		if err := p.terminate(t, 30*time.Second); err != nil {
			t.Errorf("fanout %s exited with %v after SIGTERM, want a clean exit", p.name, err)
		}
	}
	a, b := both.handled("invoicing"), one.handled("invoicing")
	t.Logf("invoicing: %d events in `subscribe invoicing cacheinval`, %d in `subscribe invoicing`", a, b)
	if a == 0 || b == 0 || a+b != orders {
		t.Errorf("invoicing handled %d + %d events, want both processes to share the %d", a, b, orders)
	}
	if one.handled("cacheinval") != 0 {
		t.Error("`subscribe invoicing` ran the cache invalidator")
	}
	if !strings.Contains(both.output(), `"msg":"subscriber stopped"`) || !strings.Contains(relayProc.output(), `"msg":"relay stopped"`) {
		t.Error("a process did not log its graceful stop")
	}
}

// A relay that cannot publish (NATS down) reports not ready once the oldest
// pending row is older than http.ready_max_pending_age, and ready again once
// it caught up; `fanout healthcheck` says the same.
func TestReadinessFailsOnAStalledRelay(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + nats.URL, "FANOUT_LOG_FORMAT=json",
		"FANOUT_HTTP_ADDR=127.0.0.1:0", "FANOUT_HTTP_READY_MAX_PENDING_AGE=1s", "FANOUT_RELAY_POLL_INTERVAL=50ms",
	}
	relayProc := start(t, env, "relay")
	addr := relayProc.opsAddr(t)
	if code, body := get(t, addr, "/readyz"); code != 200 {
		t.Fatalf("a fresh relay is not ready: %d %s", code, body)
	}
	nats.Stop()
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 3, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	var body string
	subscribertest.WaitFor(t, 15*time.Second, "readiness to fail on the stalled outbox", func() (bool, string) {
		var code int
		code, body = get(t, addr, "/readyz")
		return code == 503 && strings.Contains(body, "stalled"), body
	})
	if !strings.Contains(body, "stalled") || !strings.Contains(body, "nats") {
		t.Errorf("/readyz while stalled: %s; want the outbox and nats failures named", body)
	}
	hc := exec.Command(binary, "healthcheck")
	hc.Env = append(os.Environ(), "FANOUT_HTTP_ADDR="+addr)
	if out, err := hc.CombinedOutput(); err == nil {
		t.Errorf("fanout healthcheck on a stalled relay succeeded: %s", out)
	}
	if err := nats.Restart(); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, 20*time.Second, "readiness to come back", func() (bool, string) {
		code, body := get(t, addr, "/readyz")
		return code == 200, body
	})
	hc = exec.Command(binary, "healthcheck")
	hc.Env = append(os.Environ(), "FANOUT_HTTP_ADDR="+addr)
	if out, err := hc.CombinedOutput(); err != nil || !strings.Contains(string(out), "ready") {
		t.Errorf("fanout healthcheck on a ready relay: %v %s", err, out)
	}
}

func TestUnknownSubscriberAndBadConfigAreClearErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  []string
		args []string
		want string
	}{
		{nil, []string{"subscribe", "billing"}, `unknown subscriber "billing" (known: cacheinval, invoicing, salesledger, searchindex)`},
		{[]string{"FANOUT_SUBSCRIBERS_MAX_FAILURES=0"}, []string{"subscribe", "invoicing"}, "subscribers.max_failures must be between 1 and 1000 (got 0)"},
		{[]string{"FANOUT_SUBSCRIBERS_MAX_DELIVER=10"}, []string{"subscribe", "invoicing"}, `config key "subscribers.max_deliver" is gone: replaced by subscribers.max_failures`},
		{[]string{"FANOUT_RELAY_MAX_IN_FLIGHT=600", "FANOUT_RELAY_BATCH_SIZE=1000"}, []string{"relay"}, "relay.max_in_flight (600) must be at least relay.batch_size (1000)"},
		{[]string{"FANOUT_RELAY_BATCH_SIZE=abc"}, []string{"relay"}, "relay.batch_size"},
		{nil, []string{"subscribe", "invoicing", "--start", "yesterday"}, "subscribers.start must be one of all, new, time"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		cmd := exec.CommandContext(ctx, binary, tc.args...)
		cmd.Env = append(os.Environ(), tc.env...)
		out, err := cmd.CombinedOutput()
		cancel()
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("fanout %v with %v: %v\n%s\nwant an error containing %q", tc.args, tc.env, err, out, tc.want)
		}
	}
}

// Secrets never reach logs, errors or `config print`, whichever way they
// were given.
func TestSecretsStayOutOfOutput(t *testing.T) {
	t.Parallel()
	pwFile := t.TempDir() + "/pg-password"
	if err := os.WriteFile(pwFile, []byte("file-s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := []string{
		"FANOUT_POSTGRES_PASSWORD_FILE=" + pwFile,
		"FANOUT_NATS_URL=nats://relay:url-s3cret@127.0.0.1:1", // nothing listens: the error names the URL
		"FANOUT_SEARCH_PASSWORD=search-s3cret", "FANOUT_NATS_TOKEN=token-s3cret",
		"FANOUT_LOG_FORMAT=json", "FANOUT_LOG_LEVEL=debug", "FANOUT_HTTP_ADDR=",
	}
	for _, args := range [][]string{{"config", "print"}, {"relay"}, {"subscribe", "invoicing"}, {"status"}} {
		out, _ := run(t, env, args...)
		if strings.Contains(out, "s3cret") {
			t.Errorf("fanout %v printed a secret:\n%s", args, out)
		}
		if args[0] == "config" && (!strings.Contains(out, "<redacted>") || !strings.Contains(out, "relay:xxxxx@")) {
			t.Errorf("config print does not show that secrets are set:\n%s", out)
		}
	}
}
