package main

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/faultproxy"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/redistest"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
)

// A subscriber whose services are down or too slow to answer when it
// starts waits for them, saying which and what it called, and starts once
// they answer: the first call to a loaded search engine (making its
// index) once timed out and the role exited, and a fault run waited for
// a consumer that was never made.
func TestSubscriberWaitsForItsServicesAtStart(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	redis := redistest.Start(t)
	alias := searchtest.Alias(t, searchtest.Client(t, search.OpenSearch))
	redisProxy := newProxy(t, redis.Addr)
	searchProxy := newProxy(t, strings.TrimPrefix(searchtest.URL(), "http://"))
	redisProxy.Cut()
	searchProxy.Slow(1500 * time.Millisecond) // past search.timeout: every call times out

	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL,
		"FANOUT_NATS_URL=" + nats.URL,
		"FANOUT_REDIS_URL=redis://" + redisProxy.Addr,
		"FANOUT_SEARCH_ENGINE=opensearch", "FANOUT_SEARCH_URL=http://" + searchProxy.Addr, "FANOUT_SEARCH_ALIAS=" + alias,
		"FANOUT_SEARCH_TIMEOUT=1s",
		"FANOUT_LOG_FORMAT=json",
		"FANOUT_HTTP_ADDR=127.0.0.1:0",
	}
	start(t, env, "relay")
	p := start(t, env, "subscribe", "cacheinval", "searchindex")
	waitLogged(t, p, `"msg":"waiting for redis to start"`, `"call":"ping"`)
	redisProxy.Restore()
	p.waitStarted(t, "cacheinval")
	waitLogged(t, p, `"msg":"waiting for search to start"`, "deadline exceeded")
	searchProxy.Restore()
	p.waitStarted(t, "searchindex")
	if err := p.terminate(t, 30*time.Second); err != nil {
		t.Fatalf("fanout subscribe exited with %v after its services came back", err)
	}
}

// The relay and a subscriber started while Postgres, then NATS, are
// unreachable wait for each, saying so, and start once they answer: a
// role is not ended by an outage at its start any more than by one later.
func TestRolesWaitForPostgresAndNATSAtStart(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ns := natstest.Start(t)
	pgURL, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pgProxy := newProxy(t, pgURL.Host)
	natsProxy := newProxy(t, strings.TrimPrefix(ns.URL, "nats://"))
	pgProxy.Cut()
	natsProxy.Cut()
	pgURL.Host = pgProxy.Addr
	env := []string{
		"FANOUT_POSTGRES_URL=" + pgURL.String(),
		"FANOUT_NATS_URL=nats://" + natsProxy.Addr,
		"FANOUT_LOG_FORMAT=json",
		"FANOUT_HTTP_ADDR=127.0.0.1:0",
	}
	relay := start(t, env, "relay")
	sub := start(t, env, "subscribe", "invoicing")
	for _, p := range []*process{relay, sub} {
		waitLogged(t, p, `"msg":"waiting for postgres to start"`, `"call":"connect"`)
	}
	pgProxy.Restore()
	for _, p := range []*process{relay, sub} {
		waitLogged(t, p, `"msg":"waiting for nats to start"`, `"call":"connect"`)
	}
	natsProxy.Restore()
	waitLogged(t, relay, `"msg":"relay started"`)
	sub.waitStarted(t, "invoicing")
	for _, p := range []*process{relay, sub} {
		if err := p.terminate(t, 30*time.Second); err != nil {
			t.Fatalf("fanout %s exited with %v after Postgres and NATS came back", p.name, err)
		}
	}
}

// An error waiting cannot mend is not waited for: the role exits with it.
func TestStartWaitsOnlyForOutages(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("create index: %w", &search.Error{Status: 503}), true},
		{fmt.Errorf("create index: %w", &search.Error{Status: 429}), true},
		{fmt.Errorf("create index: %w", &search.Error{Status: 400, Type: "mapper_parsing_exception"}), false},
		{fmt.Errorf("info: %w", &search.Error{Status: 401}), false},
		{fmt.Errorf("dial: %w", syscall.ECONNREFUSED), true},
		{errors.New("search.alias must be set"), false},
		{fmt.Errorf("connect to postgres: %w", &pgconn.PgError{Code: "57P03", Message: "the database system is starting up"}), true},
		{fmt.Errorf("connect to postgres: %w", &pgconn.PgError{Code: "53300", Message: "too many connections"}), true},
		{fmt.Errorf("connect to postgres: %w", &pgconn.PgError{Code: "28P01", Message: "password authentication failed"}), false},
		{fmt.Errorf("connect to nats: %w", nats.ErrNoServers), true},
		{fmt.Errorf("connect to nats: %w", nats.ErrAuthorization), false},
		{errors.New("connect to nats at nats://127.0.0.1:4222: nats: expected 'PONG', got 'PING'"), true},
		{errors.New("connect to nats: tls: failed to verify certificate: x509: certificate signed by unknown authority"), false},
	} {
		if got := outage(c.err); got != c.want {
			t.Errorf("outage(%v) = %t, want %t", c.err, got, c.want)
		}
	}
}

func newProxy(t *testing.T, target string) *faultproxy.Proxy {
	t.Helper()
	p, err := faultproxy.New(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// waitLogged waits for a log line holding every one of parts.
func waitLogged(t *testing.T, p *process, parts ...string) {
	t.Helper()
	subscribertest.WaitFor(t, 30*time.Second, fmt.Sprintf("a line with %q in the log of %s", parts, p.name), func() (bool, string) {
		for _, line := range strings.Split(p.output(), "\n") {
			found := true
			for _, part := range parts {
				found = found && strings.Contains(line, part)
			}
			if found {
				return true, ""
			}
		}
		return false, ""
	})
}
