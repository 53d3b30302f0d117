package deploy_test

// These tests run the real relay and subscribers under the production
// nats-server configuration (deploy/nats/nats-server.conf) and the database
// roles of deploy/postgres/roles.sql, and show what each role may and may
// not do: every refusal is the server's own (a NATS permissions violation
// naming the subject, SQLSTATE 42501 from PostgreSQL).

import (
	"crypto/rand"
	"encoding/hex"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// ---------------------------------------------------------------------------
// helpers

// settings are the sections these tests run the roles with.
type settings struct {
	Postgres    connect.PostgresConfig
	NATS        connect.NATSConfig
	Stream      stream.Config
	Relay       relay.Config
	Subscribers subscribers.Config
}

// loadConfig is each package's defaults, as `fanout` runs without a file
// or a variable, with a quick relay.
func loadConfig(t *testing.T) *settings {
	t.Helper()
	cfg := &settings{Postgres: connect.DefaultPostgres(), NATS: connect.DefaultNATS(), Stream: stream.DefaultConfig(),
		Relay: relay.DefaultConfig(), Subscribers: subscribers.DefaultConfig()}
	cfg.Relay.PollInterval = 50 * time.Millisecond
	return cfg
}

// waitFor polls cond until it holds, failing t after 20s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// logRecorder keeps the lines a slog.TextHandler writes (one per record).
type logRecorder struct {
	mu  sync.Mutex
	all []string
}

func (l *logRecorder) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.all = append(l.all, strings.TrimSpace(string(p)))
	return len(p), nil
}

func (l *logRecorder) lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.all...)
}

// checkpoint makes sure every async error nc's server sent so far has been
// logged: it publishes where user may not and waits for that violation's
// log line (the server and the client keep the order).
func (l *logRecorder) checkpoint(t *testing.T, nc *nats.Conn, user string) {
	t.Helper()
	marker := "leastprivilege.checkpoint." + user
	if err := nc.Publish(marker, nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the marker violation of "+user, func() bool {
		for _, line := range l.lines() {
			if strings.Contains(line, `msg="nats async error"`) && strings.Contains(line, marker) {
				return true
			}
		}
		return false
	})
}
