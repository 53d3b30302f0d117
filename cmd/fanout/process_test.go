package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/redistest"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/registry"
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

func TestUnknownSubscriberAndBadConfigAreClearErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  []string
		args []string
		want string
	}{
		{nil, []string{"subscribe", "billing"}, `unknown subscriber "billing" (known: ` + strings.Join(registry.Default.Names(), ", ") + ")"},
		{[]string{"FANOUT_SUBSCRIBERS_MAX_FAILURES=0"}, []string{"subscribe", "invoicing"}, "subscribers.max_failures must be between 1 and 1000 (got 0)"},
		{[]string{"FANOUT_SUBSCRIBERS_MAX_DELIVER=10"}, []string{"subscribe", "invoicing"}, `config key "subscribers.max_deliver" is gone: replaced by subscribers.max_failures`},
		{[]string{"FANOUT_RELAY_MAX_IN_FLIGHT=600", "FANOUT_RELAY_BATCH_SIZE=1000"}, []string{"relay"}, "relay.max_in_flight (600) must be at least relay.batch_size (1000)"},
		{[]string{"FANOUT_RELAY_BATCH_SIZE=abc"}, []string{"relay"}, "relay.batch_size"},
		{nil, []string{"subscribe", "invoicing", "--start", "yesterday"}, "subscribers.start must be one of all, new, time"},
		{[]string{"FANOUT_SUBSCRIBERS_DEAD_LETTER_API_PREFIX=$JS.*.API"}, []string{"subscribe", "invoicing"}, `subscribers.dead_letter_api_prefix must be a subject without wildcards, such as $JS.DEADLETTER.API (got "$JS.*.API")`},
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

// secretForm is one way of giving fanout a credential.
type secretForm struct {
	name string
	// secret must appear in no output. Each form has its own, so a
	// failure names the form that leaked.
	secret string
	// env gives the credential (over the test's working settings).
	env []string
	// bad makes the configuration invalid with the secret still given: the
	// secret's own key where possible (its error quotes the value), else a
	// key beside it; badKey is the key the error must name.
	bad    []string
	badKey string
	// shown is what `config print` shows in the secret's place: proof that
	// the secret is masked where it was, not dropped (empty: print shows
	// nothing of it, or refuses the configuration).
	shown string
	// roles get as far as the connection the credential is for, and fail
	// there (nothing listens on port 1); each must say so in its output,
	// or the command did not prove anything about that connection.
	roles []roleRun
}

type roleRun struct {
	args []string
	says string
}

// Secrets never reach logs, errors or `config print`, whichever way they
// were given: each form of credential is fed to `config print`, to `config
// check` with an invalid value, to the roles that use it (failing to
// connect: the connection errors of pgx, nats.go, go-redis and the search
// clients), and, with a working pipeline, to `fanout up`; no output may
// contain it.
func TestSecretsStayOutOfOutput(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ns := natstest.Start(t)
	dir := t.TempDir()
	secretFile := func(name, secret string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(secret+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const (
		deadPG     = "postgres://fanout@127.0.0.1:1/fanout?sslmode=disable"
		deadNATS   = "nats://127.0.0.1:1"
		badBatch   = "FANOUT_RELAY_BATCH_SIZE=0"
		batchKey   = "relay.batch_size"
		otlpOn     = "FANOUT_TRACING_EXPORTER=otlp"
		deadOTLP   = "http://127.0.0.1:1/v1/traces"
		pgFails    = "connect to postgres"
		natsFails  = "connect to nats"
		redisFails = "connect to redis"
		osFails    = "connect to opensearch"
	)
	// The roles that reach each connection: Postgres first, then NATS,
	// then Redis or the search engine; everything before the failing one
	// works.
	pgRoles := []roleRun{{[]string{"relay"}, pgFails}, {[]string{"status"}, pgFails}}
	natsRoles := []roleRun{{[]string{"relay"}, natsFails}, {[]string{"status"}, natsFails}}
	redisRoles := []roleRun{{[]string{"subscribe", "cacheinval"}, redisFails}}
	searchRoles := []roleRun{{[]string{"subscribe", "searchindex"}, osFails}}
	// Tracing is set up at load, before any connection, and the exporter
	// reads the OTEL_ variables then: a role and the probe show what it says.
	otlpRoles := []roleRun{{[]string{"relay"}, pgFails}, {[]string{"healthcheck"}, "http.addr is empty"}}

	forms := []secretForm{
		{name: "postgres.url userinfo", secret: "PgUserinfoS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=postgres://fanout:PgUserinfoS3cret@127.0.0.1:1/fanout?sslmode=disable"},
			bad:    []string{"FANOUT_POSTGRES_URL=postgresx://fanout:PgUserinfoS3cret@127.0.0.1:1/fanout"},
			badKey: "postgres.url", shown: "fanout:xxxxx@127.0.0.1:1", roles: pgRoles},
		{name: "postgres.url ?password=", secret: "PgQueryS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=postgres://fanout@127.0.0.1:1/fanout?sslmode=disable&password=PgQueryS3cret"},
			bad:    []string{"FANOUT_POSTGRES_URL=postgresx://fanout@127.0.0.1:1/fanout?password=PgQueryS3cret"},
			badKey: "postgres.url", shown: "sslmode=disable&password=xxxxx", roles: pgRoles},
		{name: "postgres.url ?sslpassword=", secret: "PgSSLKeyS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=postgres://fanout@127.0.0.1:1/fanout?sslmode=disable&sslpassword=PgSSLKeyS3cret"},
			bad:    []string{"FANOUT_POSTGRES_URL=postgresx://fanout@127.0.0.1:1/fanout?sslpassword=PgSSLKeyS3cret"},
			badKey: "postgres.url", shown: "sslpassword=xxxxx", roles: pgRoles},
		{name: "postgres.url list of hosts", secret: "PgMultiHostS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=postgres://fanout:PgMultiHostS3cret@127.0.0.1:1,127.0.0.1:2/fanout?sslmode=disable"},
			bad:    []string{"FANOUT_POSTGRES_URL=postgresx://fanout:PgMultiHostS3cret@127.0.0.1:1,127.0.0.1:2/fanout"},
			badKey: "postgres.url", shown: "fanout:xxxxx@127.0.0.1:1,127.0.0.1:2", roles: pgRoles},
		// libpq's keyword/value form: pgx takes it, fanout refuses it (not a
		// URL), and its error must not quote the password.
		{name: "postgres.url keyword/value", secret: "PgKeywordS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=host=127.0.0.1 port=1 user=fanout password=PgKeywordS3cret sslmode=disable"},
			bad:    []string{"FANOUT_POSTGRES_URL=host=127.0.0.1 port=1 user=fanout password='PgKeywordS3cret x' sslmode=disable"},
			badKey: "postgres.url", roles: []roleRun{{[]string{"relay"}, "postgres.url"}}},
		{name: "postgres.password", secret: "PgFieldS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=" + deadPG, "FANOUT_POSTGRES_PASSWORD=PgFieldS3cret"},
			badKey: batchKey, shown: "password: <redacted>", roles: pgRoles},
		{name: "postgres.password_file", secret: "PgFileS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=" + deadPG, "FANOUT_POSTGRES_PASSWORD_FILE=" + secretFile("pg", "PgFileS3cret")},
			badKey: batchKey, shown: "password: <redacted>", roles: pgRoles},

		{name: "nats.url user:password", secret: "NatsUserinfoS3cret",
			env:    []string{"FANOUT_NATS_URL=nats://relay:NatsUserinfoS3cret@127.0.0.1:1"},
			bad:    []string{"FANOUT_NATS_URL=natsx://relay:NatsUserinfoS3cret@127.0.0.1:1"},
			badKey: "nats.url", shown: "nats://relay:xxxxx@127.0.0.1:1", roles: natsRoles},
		// A user without a password in a NATS URL is a token.
		{name: "nats.url token", secret: "NatsURLTokenS3cret",
			env:    []string{"FANOUT_NATS_URL=nats://NatsURLTokenS3cret@127.0.0.1:1"},
			bad:    []string{"FANOUT_NATS_URL=natsx://NatsURLTokenS3cret@127.0.0.1:1"},
			badKey: "nats.url", shown: "nats://xxxxx@127.0.0.1:1", roles: natsRoles},
		{name: "nats.url list", secret: "NatsListS3cret",
			env:    []string{"FANOUT_NATS_URL=nats://127.0.0.1:1,nats://relay:NatsListS3cret@127.0.0.1:2"},
			bad:    []string{"FANOUT_NATS_URL=nats://127.0.0.1:1,natsx://relay:NatsListS3cret@127.0.0.1:2"},
			badKey: "nats.url", shown: "nats://127.0.0.1:1,nats://relay:xxxxx@127.0.0.1:2", roles: natsRoles},
		{name: "nats.password", secret: "NatsFieldS3cret",
			env:    []string{"FANOUT_NATS_URL=" + deadNATS, "FANOUT_NATS_USER=relay", "FANOUT_NATS_PASSWORD=NatsFieldS3cret"},
			badKey: batchKey, shown: "password: <redacted>", roles: natsRoles},
		{name: "nats.password_file", secret: "NatsFileS3cret",
			env:    []string{"FANOUT_NATS_URL=" + deadNATS, "FANOUT_NATS_USER=relay", "FANOUT_NATS_PASSWORD_FILE=" + secretFile("nats", "NatsFileS3cret")},
			badKey: batchKey, shown: "password: <redacted>", roles: natsRoles},
		{name: "nats.token", secret: "NatsTokenS3cret",
			env:    []string{"FANOUT_NATS_URL=" + deadNATS, "FANOUT_NATS_TOKEN=NatsTokenS3cret"},
			badKey: batchKey, shown: "token: <redacted>", roles: natsRoles},
		{name: "nats.token_file", secret: "NatsTokenFileS3cret",
			env:    []string{"FANOUT_NATS_URL=" + deadNATS, "FANOUT_NATS_TOKEN_FILE=" + secretFile("token", "NatsTokenFileS3cret")},
			badKey: batchKey, shown: "token: <redacted>", roles: natsRoles},

		{name: "redis.url password", secret: "RedisURLS3cret",
			env:    []string{"FANOUT_REDIS_URL=redis://:RedisURLS3cret@127.0.0.1:1/0"},
			bad:    []string{"FANOUT_REDIS_URL=redisx://:RedisURLS3cret@127.0.0.1:1/0"},
			badKey: "redis.url", shown: "redis://:xxxxx@127.0.0.1:1/0", roles: redisRoles},
		{name: "redis.url user:password", secret: "RedisUserinfoS3cret",
			env:    []string{"FANOUT_REDIS_URL=redis://cache:RedisUserinfoS3cret@127.0.0.1:1/0"},
			bad:    []string{"FANOUT_REDIS_URL=redisx://cache:RedisUserinfoS3cret@127.0.0.1:1/0"},
			badKey: "redis.url", shown: "redis://cache:xxxxx@127.0.0.1:1/0", roles: redisRoles},
		{name: "redis.password", secret: "RedisFieldS3cret",
			env:    []string{"FANOUT_REDIS_PASSWORD=RedisFieldS3cret"},
			badKey: batchKey, shown: "password: <redacted>", roles: redisRoles},
		{name: "redis.password_file", secret: "RedisFileS3cret",
			env:    []string{"FANOUT_REDIS_PASSWORD_FILE=" + secretFile("redis", "RedisFileS3cret")},
			badKey: batchKey, shown: "password: <redacted>", roles: redisRoles},

		{name: "search.url user:password", secret: "SearchUserinfoS3cret",
			env:    []string{"FANOUT_SEARCH_URL=http://elastic:SearchUserinfoS3cret@127.0.0.1:1"},
			bad:    []string{"FANOUT_SEARCH_URL=ftp://elastic:SearchUserinfoS3cret@127.0.0.1:1"},
			badKey: "search.url", shown: "http://elastic:xxxxx@127.0.0.1:1", roles: searchRoles},
		{name: "search.username and password", secret: "SearchFieldS3cret",
			env:    []string{"FANOUT_SEARCH_USERNAME=elastic", "FANOUT_SEARCH_PASSWORD=SearchFieldS3cret"},
			badKey: batchKey, shown: "password: <redacted>", roles: searchRoles},
		{name: "search.password_file", secret: "SearchFileS3cret",
			env:    []string{"FANOUT_SEARCH_USERNAME=elastic", "FANOUT_SEARCH_PASSWORD_FILE=" + secretFile("search", "SearchFileS3cret")},
			badKey: batchKey, shown: "password: <redacted>", roles: searchRoles},

		{name: "tracing.otlp_endpoint userinfo", secret: "OTLPUserinfoS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=" + deadPG, otlpOn, "FANOUT_TRACING_OTLP_ENDPOINT=http://otel:OTLPUserinfoS3cret@127.0.0.1:1/v1/traces"},
			bad:    []string{otlpOn, "FANOUT_TRACING_OTLP_ENDPOINT=ftp://otel:OTLPUserinfoS3cret@127.0.0.1:1/v1/traces"},
			badKey: "tracing.otlp_endpoint", shown: "http://otel:xxxxx@127.0.0.1:1/v1/traces", roles: otlpRoles},
		{name: "tracing.otlp_endpoint ?api_key=", secret: "OTLPQueryS3cret",
			env:    []string{"FANOUT_POSTGRES_URL=" + deadPG, otlpOn, "FANOUT_TRACING_OTLP_ENDPOINT=" + deadOTLP + "?api_key=OTLPQueryS3cret"},
			bad:    []string{otlpOn, "FANOUT_TRACING_OTLP_ENDPOINT=ftp://127.0.0.1:1/v1/traces?api_key=OTLPQueryS3cret"},
			badKey: "tracing.otlp_endpoint", shown: "/v1/traces?api_key=xxxxx", roles: otlpRoles},
		{name: "OTEL_EXPORTER_OTLP_HEADERS", secret: "OTLPHeaderS3cret",
			env: []string{"FANOUT_POSTGRES_URL=" + deadPG, otlpOn, "FANOUT_TRACING_OTLP_ENDPOINT=" + deadOTLP,
				"OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20OTLPHeaderS3cret"},
			badKey: batchKey, roles: otlpRoles},
		// A header written as `name: value` is malformed; OpenTelemetry
		// complains, and must not quote it.
		{name: "OTEL_EXPORTER_OTLP_TRACES_HEADERS malformed", secret: "OTLPBadHeaderS3cret",
			env: []string{"FANOUT_POSTGRES_URL=" + deadPG, otlpOn, "FANOUT_TRACING_OTLP_ENDPOINT=" + deadOTLP,
				"OTEL_EXPORTER_OTLP_TRACES_HEADERS=x-api-key:OTLPBadHeaderS3cret"},
			badKey: batchKey, roles: []roleRun{{[]string{"relay"}, "parse headers"}, {[]string{"healthcheck"}, "parse headers"}}},
		{name: "OTEL_EXPORTER_OTLP_ENDPOINT malformed", secret: "OTLPBadEndpointS3cret",
			env: []string{"FANOUT_POSTGRES_URL=" + deadPG, otlpOn,
				"OTEL_EXPORTER_OTLP_ENDPOINT=http://otel:OTLPBadEndpointS3cret@127.0.0.1:1/%zz?api_key=OTLPBadEndpointS3cret"},
			badKey: batchKey, roles: []roleRun{{[]string{"relay"}, "parse url"}, {[]string{"healthcheck"}, "parse url"}}},
		{name: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", secret: "OTLPEnvEndpointS3cret",
			env: []string{"FANOUT_POSTGRES_URL=" + deadPG, otlpOn,
				"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://otel:OTLPEnvEndpointS3cret@127.0.0.1:1/v1/traces?api_key=OTLPEnvEndpointS3cret"},
			badKey: batchKey, roles: otlpRoles},
	}

	base := []string{
		"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + ns.URL,
		"FANOUT_REDIS_URL=redis://127.0.0.1:1/0", "FANOUT_REDIS_TIMEOUT=1s",
		"FANOUT_SEARCH_ENGINE=opensearch", "FANOUT_SEARCH_URL=http://127.0.0.1:1", "FANOUT_SEARCH_TIMEOUT=2s",
		"FANOUT_LOG_FORMAT=json", "FANOUT_LOG_LEVEL=debug", "FANOUT_HTTP_ADDR=",
	}
	noSecret := func(t *testing.T, what, out, secret string) {
		t.Helper()
		if strings.Contains(out, secret) {
			t.Errorf("%s printed the secret %q:\n%s", what, secret, out)
		}
	}
	for _, f := range forms {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			env := append(slices.Clip(base), f.env...)

			out, err := run(t, env, "config", "print")
			noSecret(t, "config print", out, f.secret)
			if f.shown != "" && (err != nil || !strings.Contains(out, f.shown)) {
				t.Errorf("config print (%v) does not show %q in the secret's place:\n%s", err, f.shown, out)
			}

			bad := f.bad
			if bad == nil {
				bad = append(slices.Clip(f.env), badBatch)
			}
			out, err = run(t, append(slices.Clip(base), bad...), "config", "check")
			noSecret(t, "config check", out, f.secret)
			if err == nil || !strings.Contains(out, f.badKey) {
				t.Errorf("config check with %v: %v, want an error naming %s:\n%s", bad, err, f.badKey, out)
			}

			for _, r := range f.roles {
				out, said := runUntil(t, env, r.says, r.args...)
				noSecret(t, fmt.Sprint(r.args), out, f.secret)
				if !said {
					t.Errorf("fanout %v: want a failure saying %q (else it never reached the credential's use):\n%s", r.args, r.says, out)
				}
			}
		})
	}

	// `fanout up` with every credential that a working pipeline can be
	// given here (the local servers take no passwords, so they ignore
	// them): its banner, progress lines and logs, across a NATS restart
	// (the reconnect is logged with the server's URL), and the flush of
	// spans to a collector that is not there.
	t.Run("up", func(t *testing.T) {
		t.Parallel()
		db := pgtest.NewDB(t)
		ns := natstest.Start(t)
		rs := redistest.Start(t)
		sc := searchtest.Client(t, search.OpenSearch)
		alias := searchtest.Alias(t, sc)
		withUser := func(raw string, user *url.Userinfo, query string) string {
			u, err := url.Parse(raw)
			if err != nil {
				t.Fatal(err)
			}
			u.User = user
			if query != "" {
				if u.RawQuery != "" {
					u.RawQuery += "&"
				}
				u.RawQuery += query
			}
			return u.String()
		}
		secrets := []string{"UpPgUserinfoS3cret", "UpPgQueryS3cret", "UpNatsTokenS3cret", "UpSearchUserinfoS3cret",
			"UpSearchFileS3cret", "UpOTLPUserinfoS3cret", "UpOTLPQueryS3cret", "UpOTLPHeaderS3cret"}
		env := []string{
			"FANOUT_POSTGRES_URL=" + withUser(db.URL, url.UserPassword("postgres", "UpPgUserinfoS3cret"), "password=UpPgQueryS3cret"),
			"FANOUT_NATS_URL=" + withUser(ns.URL, url.User("UpNatsTokenS3cret"), ""),
			"FANOUT_REDIS_URL=" + rs.URL,
			"FANOUT_SEARCH_ENGINE=opensearch", "FANOUT_SEARCH_ALIAS=" + alias,
			"FANOUT_SEARCH_URL=" + withUser(searchtest.URL(), url.UserPassword("admin", "UpSearchUserinfoS3cret"), ""),
			"FANOUT_SEARCH_USERNAME=admin", "FANOUT_SEARCH_PASSWORD_FILE=" + secretFile("up-search", "UpSearchFileS3cret"),
			otlpOn, "FANOUT_TRACING_OTLP_ENDPOINT=http://otel:UpOTLPUserinfoS3cret@127.0.0.1:1/v1/traces?api_key=UpOTLPQueryS3cret",
			"OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20UpOTLPHeaderS3cret",
			"FANOUT_DEMO_RATE=20", "FANOUT_DEMO_PRODUCTS=20", "FANOUT_DEMO_PROGRESS_INTERVAL=200ms",
			"FANOUT_LOG_FORMAT=json", "FANOUT_HTTP_ADDR=", "FANOUT_RELAY_POLL_INTERVAL=50ms",
		}
		up := start(t, env, "up")
		subscribertest.WaitFor(t, 60*time.Second, "the banner and a progress line of fanout up", func() (bool, string) {
			out := up.output()
			return strings.Contains(out, "fanout up:") && strings.Contains(out, "] written"), out
		})
		ns.Stop()
		if err := ns.Restart(); err != nil {
			t.Fatal(err)
		}
		subscribertest.WaitFor(t, 30*time.Second, "fanout up to reconnect to NATS", func() (bool, string) {
			return strings.Contains(up.output(), `"msg":"nats reconnected"`), ""
		})
		// Ctrl-C, as a user stops it (the other roles' tests send SIGTERM,
		// as a container runtime does): a clean stop exits 0.
		if err := up.stopWith(t, os.Interrupt, 60*time.Second); err != nil {
			t.Errorf("fanout up exited with %v after Ctrl-C (SIGINT)", err)
		}
		out := up.output()
		for _, s := range secrets {
			noSecret(t, "fanout up", out, s)
		}
		if !strings.Contains(out, "nats://xxxxx@127.0.0.1:") {
			t.Errorf("the banner of fanout up does not show the NATS URL, masked:\n%s", out)
		}
	})
}
