package deploy_test

// These tests run the real relay and subscribers under the production
// nats-server configuration (deploy/nats/nats-server.conf) and the database
// roles of deploy/postgres/roles.sql, and show what each role may and may
// not do: every refusal is the server's own (a NATS permissions violation
// naming the subject, SQLSTATE 42501 from PostgreSQL).

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/internal/pgtest"
	"github.com/fanout/fanout/internal/repo"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// ---------------------------------------------------------------------------
// nats-server under deploy/nats/nats-server.conf

// natsUsers are the users of the configuration file: fanout's own roles
// and a user per subscriber in the registry.
var natsUsers = append([]string{"relay", "provisioner", "operator", "admin"}, registry.Default.Names()...)

type natsServer struct {
	url       string
	passwords map[string]string // plain passwords, as the clients send them
	cmd       *exec.Cmd
	exited    chan struct{}
	log       *syncBuffer
}

// startNATS runs the pinned nats-server with the production configuration
// file on a free port, the passwords (bcrypt hashes, except admin's plain
// one) and the store directory in its environment, and stops it when t ends.
func startNATS(t *testing.T) *natsServer {
	t.Helper()
	return startNATSWith(t, natsConfPath(t), natsUsers)
}

// startNATSWith runs nats-server with the configuration file conf, whose
// users are users.
func startNATSWith(t *testing.T, conf string, users []string) *natsServer {
	t.Helper()
	bin, err := repo.Bin("nats-server")
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	s := &natsServer{
		url:       fmt.Sprintf("nats://127.0.0.1:%d", port),
		passwords: make(map[string]string),
		exited:    make(chan struct{}),
		log:       &syncBuffer{},
	}
	env := os.Environ()
	for _, u := range users {
		pw := "pw" + randomHex(t, 16)
		s.passwords[u] = pw
		secret := pw
		if u != "admin" {
			secret = bcryptHash(t, pw)
		}
		env = append(env, "FANOUT_NATS_"+strings.ToUpper(u)+"_PASSWORD="+secret)
	}
	env = append(env, "FANOUT_NATS_STORE_DIR="+filepath.Join(t.TempDir(), "jetstream"))
	s.cmd = exec.Command(bin, "-c", conf, "-p", strconv.Itoa(port))
	s.cmd.Env = env // the last of duplicate keys wins
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start nats-server: %v", err)
	}
	go func() {
		_ = s.cmd.Wait()
		close(s.exited)
	}()
	t.Cleanup(s.stop)

	deadline := time.Now().Add(15 * time.Second)
	for {
		nc, err := nats.Connect(s.url, nats.UserInfo("admin", s.passwords["admin"]), nats.Timeout(time.Second))
		if err == nil {
			js, jerr := jetstream.New(nc)
			if jerr == nil {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_, jerr = js.AccountInfo(ctx)
				cancel()
			}
			nc.Close()
			if jerr == nil {
				return s
			}
			err = jerr
		}
		if time.Now().After(deadline) {
			t.Fatalf("nats-server on port %d not ready: %v\n%s", port, err, s.log.String())
		}
		select {
		case <-s.exited:
			t.Fatalf("nats-server exited at start:\n%s", s.log.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (s *natsServer) stop() {
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}

func natsConfPath(t *testing.T) string {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "deploy", "nats", "nats-server.conf")
}

// bcryptHash hashes a password as `nats server passwd` does (at the lowest
// cost, to keep the test fast).
func bcryptHash(t *testing.T, pw string) string {
	t.Helper()
	cli, err := repo.Bin("nats")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(cli, "server", "passwd", "--pass", pw, "--cost", "4").CombinedOutput()
	if err != nil {
		t.Fatalf("nats server passwd: %v\n%s", err, out)
	}
	h := strings.TrimSpace(string(out))
	if !strings.HasPrefix(h, "$2a$") {
		t.Fatalf("nats server passwd printed %q, not a bcrypt hash", h)
	}
	return h
}

// natsClient is one user's connection; its async errors (the server's
// permissions violations) arrive on errs.
type natsClient struct {
	user       string
	nc         *nats.Conn
	js         jetstream.JetStream
	errs       chan error
	unexpected []error
}

// connect connects as user through the production code path
// (connect.NATS with nats.user and nats.password: its inboxes are
// _INBOX_<user>), and takes over the connection's async errors.
func (s *natsServer) connect(t *testing.T, user string) *natsClient {
	t.Helper()
	c := &natsClient{user: user, errs: make(chan error, 1000)}
	cfg := config.NATS{URL: s.url, User: user, Password: s.passwords[user], ConnectTimeout: 5 * time.Second}
	nc, err := connect.NATS(cfg, "leastprivilege-"+user, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatalf("connect as %s: %v", user, err)
	}
	t.Cleanup(nc.Close)
	nc.SetErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		select {
		case c.errs <- err:
		default:
		}
	})
	checkInboxPrefix(t, nc, user)
	c.nc = nc
	if c.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	return c
}

// waitViolation waits for the server's permissions violation for kind
// ("Publish" or "Subscription") on subject. Other async errors are kept
// for checkClean.
func (c *natsClient) waitViolation(t *testing.T, kind, subject string) {
	t.Helper()
	want := fmt.Sprintf("%s to %q", kind, subject)
	deadline := time.NewTimer(15 * time.Second)
	defer deadline.Stop()
	for {
		select {
		case err := <-c.errs:
			if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), want) {
				return
			}
			c.unexpected = append(c.unexpected, err)
		case <-deadline.C:
			t.Fatalf("%s: no permissions violation for %s within 15s: the server allowed it", c.user, want)
		}
	}
}

// deniedRequest runs op, a request on subject that the user may not make:
// the server must report the violation, and op must not succeed.
func (c *natsClient) deniedRequest(t *testing.T, subject string, op func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res := make(chan error, 1)
	go func() { res <- op(ctx) }()
	c.waitViolation(t, "Publish", subject)
	cancel() // the request has no answer coming: stop waiting for one
	if err := <-res; err == nil {
		t.Errorf("%s: request on %s succeeded", c.user, subject)
	}
}

// checkClean fails t if the server reported anything else than the
// violations the test provoked. A last denied publish serves as a marker:
// the server answers in order and the client reports errors in order, so
// once its violation arrives every earlier one has.
func (c *natsClient) checkClean(t *testing.T) {
	t.Helper()
	marker := "leastprivilege.checkpoint." + c.user
	if err := c.nc.Publish(marker, nil); err != nil {
		t.Fatal(err)
	}
	c.waitViolation(t, "Publish", marker)
	for _, err := range c.unexpected {
		t.Errorf("%s: unexpected async error: %v", c.user, err)
	}
	c.unexpected = nil
}

// ---------------------------------------------------------------------------
// PostgreSQL roles from deploy/postgres/roles.sql

// rolesLock serializes applications of roles.sql across test processes:
// roles are cluster-wide. Advisory locks are per database, so it is taken
// in the admin database.
const rolesLock = 0x666f726f6c6573

// applyRoles runs roles.sql with psql against dbURL, as a DBA would, with
// env added to psql's environment, and returns what psql printed.
func applyRoles(t *testing.T, dbURL string, env ...string) string {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	return applyRolesFile(t, filepath.Join(root, "deploy", "postgres", "roles.sql"), dbURL, env...)
}

// applyRolesFile runs the roles script at path (see applyRoles).
func applyRolesFile(t *testing.T, path, dbURL string, env ...string) string {
	t.Helper()
	psql, err := exec.LookPath("psql")
	if err != nil {
		psql = "/usr/lib/postgresql/15/bin/psql"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out []byte
	withRolesLock(t, func(*pgx.Conn) error {
		cmd := exec.CommandContext(ctx, psql, "-X", "-q", "-v", "ON_ERROR_STOP=1",
			"-f", path, dbURL)
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "FANOUT_PG_") { // a developer's shell must not set passwords here
				cmd.Env = append(cmd.Env, kv)
			}
		}
		cmd.Env = append(cmd.Env, env...)
		var err error
		if out, err = cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("psql -f roles.sql: %w\n%s", err, out)
		}
		return nil
	})
	return string(out)
}

// withRolesLock runs fn holding rolesLock, with a superuser connection to
// the admin database.
func withRolesLock(t *testing.T, fn func(admin *pgx.Conn) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, err := pgx.Connect(ctx, pgtest.AdminURL())
	if err != nil {
		t.Fatalf("postgres not reachable (start it with deploy/services.sh up): %v", err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(rolesLock)); err != nil {
		t.Fatal(err)
	}
	defer admin.Exec(context.Background(), "SELECT pg_advisory_unlock($1)", int64(rolesLock)) //nolint:errcheck
	if err := fn(admin); err != nil {
		t.Fatal(err)
	}
}

// roleURL is dbURL with role as the user (trust authentication on loopback
// in the development cluster: no password).
func roleURL(t *testing.T, dbURL, role string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return u.String()
}

// rolePool connects to dbURL as role through the production code path.
func rolePool(t *testing.T, cfg *config.Config, dbURL, role string, opts ...connect.PostgresOption) *pgxpool.Pool {
	t.Helper()
	pc := cfg.Postgres
	pc.URL = roleURL(t, dbURL, role)
	pool, err := connect.Postgres(context.Background(), pc, role, opts...)
	if err != nil {
		t.Fatalf("connect as %s: %v", role, err)
	}
	t.Cleanup(pool.Close)
	var user string
	if err := pool.QueryRow(context.Background(), "SELECT current_user").Scan(&user); err != nil || user != role {
		t.Fatalf("connected as %q (%v), want %s", user, err, role)
	}
	return pool
}

// querier runs statements: a pool, a connection or a transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// denied runs sql, which must fail with SQLSTATE 42501
// (insufficient_privilege).
func denied(t *testing.T, q querier, who, sql string, args ...any) {
	t.Helper()
	_, err := q.Exec(context.Background(), sql, args...)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("%s: %s: got %v, want SQLSTATE 42501 (insufficient_privilege)", who, sql, err)
		return
	}
	t.Logf("refused: %-18s %s", who, strings.Join(strings.Fields(sql), " "))
}

// asRole runs fn in a transaction of the superuser pool switched to role
// (SET LOCAL ROLE), as an application role that is a member of role would,
// and rolls it back.
func asRole(t *testing.T, pool *pgxpool.Pool, role string, fn func(tx pgx.Tx)) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	fn(tx)
}

// ---------------------------------------------------------------------------
// The pipeline, every process with its own least-privilege identity

// TestLeastPrivilegePipeline runs a writer (as fanout_writer), the relay (as
// fanout_relay and NATS user relay) and the invoicing subscriber (as
// fanout_invoicing and NATS user invoicing), all through the production
// connection code, and checks that the events flow, are acked, and that a bad
// one reaches the dead letters; and that nothing any of them did was refused.
func TestLeastPrivilegePipeline(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cfg := loadConfig(t)
	db := pgtest.NewDB(t)
	applyRoles(t, db.URL)
	ns := startNATS(t)
	logs := &logRecorder{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// The business application: a product and an order, then the order's
	// event written in the same transaction under fanout_writer.
	var productID, orderID int64
	err := db.Pool.QueryRow(ctx, `
WITH b AS (INSERT INTO brands (name) VALUES ('Acme') RETURNING id),
     c AS (INSERT INTO categories (name) VALUES ('phones') RETURNING id)
INSERT INTO products (sku, name, brand_id, category_id, price)
SELECT 'SKU-1', 'Phone', b.id, c.id, 199.00 FROM b, c RETURNING id`).Scan(&productID)
	if err != nil {
		t.Fatal(err)
	}
	const unknownOrder = 1 << 40
	var goodEvent, badEvent int64
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `INSERT INTO orders (customer) VALUES ('ada') RETURNING id`).Scan(&orderID); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO order_lines (order_id, line_no, product_id, quantity, unit_price) VALUES ($1, 1, $2, 2, 199.00)`, orderID, productID); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SET LOCAL ROLE fanout_writer"); err != nil {
			return err
		}
		w := outbox.NewWriter(time.Millisecond) // its first write also notifies
		if goodEvent, err = w.Write(ctx, tx, orderEvent(orderID)); err != nil {
			return fmt.Errorf("outbox.Write as fanout_writer: %w", err)
		}
		b := &pgx.Batch{}
		if err := w.Queue(b, orderEvent(unknownOrder), &badEvent); err != nil {
			return err
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("outbox.Queue as fanout_writer: %w", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// The provisioning job (`fanout provision`'s calls, as user
	// provisioner): the streams and invoicing's consumer. The relay and
	// invoicing then only check them (verify), as in production.
	provNC := natsConn(t, cfg, ns, "provisioner", logger)
	provJS, err := jetstream.New(provNC)
	if err != nil {
		t.Fatal(err)
	}
	if err := relay.EnsureStream(ctx, provJS, cfg.Stream, config.RepublishDelay(cfg.Relay), logger); err != nil {
		t.Fatalf("provision the stream as provisioner: %v", err)
	}
	if _, err := subscribers.ProvisionDeadLetterStream(ctx, provJS, cfg.Subscribers, cfg.Stream.Replicas); err != nil {
		t.Fatalf("provision the dead-letter stream as provisioner: %v", err)
	}
	provEvents, err := provJS.Stream(ctx, cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := subscribers.ProvisionConsumer(ctx, provEvents, invoicing.Subscriber, cfg.Subscribers, cfg.Stream); err != nil {
		t.Fatalf("provision invoicing's consumer as provisioner: %v", err)
	}
	cfg.Stream.Provision = "verify"
	cfg.Subscribers.DeadLetterProvision = "verify"

	// The relay.
	relayPool := rolePool(t, cfg, db.URL, "fanout_relay", connect.AsyncCommit())
	relayNC := natsConn(t, cfg, ns, "relay", logger)
	rl, err := relay.New(relay.Options{Relay: cfg.Relay, Stream: cfg.Stream, Pool: relayPool, Conn: relayNC, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	if err := rl.Start(ctx); err != nil {
		t.Fatalf("relay start as fanout_relay / relay: %v", err)
	}
	t.Cleanup(func() {
		sctx, c := context.WithTimeout(context.Background(), 10*time.Second)
		defer c()
		_ = rl.Stop(sctx)
	})
	waitFor(t, "both outbox rows marked sent by the relay", func() bool {
		var sent int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status = 'sent' AND published_at IS NOT NULL AND id = ANY($1)`,
			[]int64{goodEvent, badEvent}).Scan(&sent)
		return err == nil && sent == 2
	})
	admin := ns.connect(t, "admin")
	events, err := admin.js.Stream(ctx, cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	seqOf := map[int64]uint64{}
	for seq := uint64(1); seq <= 2; seq++ {
		m, err := events.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("stream %s message %d: %v", cfg.Stream.Name, seq, err)
		}
		id, _ := strconv.ParseInt(m.Header.Get(outbox.EventIDHeader), 10, 64)
		seqOf[id] = seq
		if m.Subject != "events."+shop.OrderCreated {
			t.Errorf("message %d subject %s", seq, m.Subject)
		}
	}
	if seqOf[goodEvent] == 0 || seqOf[badEvent] == 0 {
		t.Fatalf("stream holds events %v, want %d and %d", seqOf, goodEvent, badEvent)
	}

	// Invoicing: it binds the consumer and the dead-letter stream the
	// provisioner made.
	invPool := rolePool(t, cfg, db.URL, "fanout_invoicing")
	invNC := natsConn(t, cfg, ns, "invoicing", logger)
	startInvoicing := func() *subscribers.Runner {
		t.Helper()
		r, err := subscribers.New(subscribers.Options{Handler: invoicing.New(), Config: cfg.Subscribers, Stream: cfg.Stream,
			Pool: invPool, Conn: invNC, Logger: logger})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Start(ctx); err != nil {
			t.Fatalf("invoicing start as fanout_invoicing / invoicing: %v", err)
		}
		t.Cleanup(func() {
			sctx, c := context.WithTimeout(context.Background(), 10*time.Second)
			defer c()
			_ = r.Stop(sctx)
		})
		return r
	}
	run := startInvoicing()
	waitFor(t, "the order's invoice", func() bool {
		var n int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices i JOIN invoice_lines l ON l.invoice_id = i.id WHERE i.order_id = $1 AND i.total = 398.00`, orderID).Scan(&n)
		return err == nil && n == 1
	})
	dl, err := admin.js.Stream(ctx, cfg.Subscribers.DeadLetterStream)
	if err != nil {
		t.Fatalf("dead-letter stream: %v", err)
	}
	waitFor(t, "the unknown order's dead letter", func() bool {
		info, err := dl.Info(ctx)
		return err == nil && info.State.Msgs == 1
	})
	first, err := dl.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if first.Subject != "deadletter.invoicing."+shop.OrderCreated ||
		first.Header.Get(outbox.EventIDHeader) != strconv.FormatInt(badEvent, 10) ||
		!strings.Contains(first.Header.Get(subscribers.DeadReasonHeader), invoicing.ErrUnknownOrder.Error()) {
		t.Errorf("dead letter: subject %s, headers %v", first.Subject, first.Header)
	}
	// Both events are settled: the good one acked, the bad one terminated.
	cons, err := jetstream.New(invNC)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the invoicing consumer to have both events acked", func() bool {
		c, err := cons.Consumer(ctx, cfg.Stream.Name, invoicing.Name)
		if err != nil {
			return false
		}
		ci := c.CachedInfo()
		return ci.NumAckPending == 0 && ci.NumPending == 0 && ci.AckFloor.Stream == 2
	})
	var checkpoints int
	if err := invPool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE subscriber = 'invoicing' AND event_id = $1`, goodEvent).Scan(&checkpoints); err != nil || checkpoints != 1 {
		t.Errorf("invoicing checkpoint of event %d: %d rows (%v)", goodEvent, checkpoints, err)
	}
	if _, err := run.Prune(ctx); err != nil {
		t.Errorf("prune checkpoints as fanout_invoicing: %v", err)
	}
	sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
	if err := run.Stop(sctx); err != nil {
		t.Errorf("stop invoicing: %v", err)
	}
	scancel()

	// A second start binds the existing consumer again.
	startInvoicing()

	// The runtime's memory of failed and redelivered events, as
	// fanout_invoicing: its own rows only.
	if _, err := invPool.Exec(ctx, `INSERT INTO subscriber_attempts (subscriber, event_id, failures) VALUES ('invoicing', 1, 1)
ON CONFLICT (subscriber, event_id) DO UPDATE SET failures = subscriber_attempts.failures + 1`); err != nil {
		t.Errorf("fanout_invoicing records an attempt: %v", err)
	}
	if _, err := invPool.Exec(ctx, `DELETE FROM subscriber_attempts WHERE subscriber = 'invoicing' AND event_id = 1`); err != nil {
		t.Errorf("fanout_invoicing forgets an attempt: %v", err)
	}
	if _, err := invPool.Exec(ctx, `INSERT INTO subscriber_attempts (subscriber, event_id, failures) VALUES ('cacheinval', 1, 99)`); err == nil {
		t.Error("fanout_invoicing wrote another subscriber's attempts")
	}

	// What these identities cannot do in Postgres.
	denied(t, relayPool, "fanout_relay", `SELECT * FROM products`)
	denied(t, relayPool, "fanout_relay", `UPDATE products SET price = 0`)
	denied(t, relayPool, "fanout_relay", `UPDATE outbox SET payload = '{}'`)
	denied(t, relayPool, "fanout_relay", `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('x', '1', 'x.y', '{}')`)
	denied(t, relayPool, "fanout_relay", `SELECT * FROM processed_events`)
	denied(t, invPool, "fanout_invoicing", `UPDATE outbox SET status = 'pending'`)
	denied(t, invPool, "fanout_invoicing", `SELECT * FROM outbox`)
	denied(t, invPool, "fanout_invoicing", `UPDATE invoices SET total = 0`)
	denied(t, invPool, "fanout_invoicing", `UPDATE products SET price = 0`)

	// Nothing the relay or invoicing did in the run was refused or failed:
	// the only warnings are the two dead letters.
	logs.checkpoint(t, relayNC, "relay")
	logs.checkpoint(t, invNC, "invoicing")
	for _, line := range logs.lines() {
		if strings.Contains(line, `msg="event dead-lettered"`) || strings.Contains(line, "leastprivilege.checkpoint.") {
			continue
		}
		t.Errorf("unexpected log: %s", line)
	}
}

func orderEvent(orderID int64) outbox.Event {
	return outbox.Event{
		AggregateType: shop.AggregateOrder,
		AggregateID:   strconv.FormatInt(orderID, 10),
		Type:          shop.OrderCreated,
		Payload:       shop.OrderEvent{OrderID: orderID, Customer: "ada", Lines: 1},
	}
}

// natsConn connects as user through the production code path (config
// nats.user / nats.password).
func natsConn(t *testing.T, cfg *config.Config, ns *natsServer, user string, logger *slog.Logger) *nats.Conn {
	t.Helper()
	nc := cfg.NATS
	nc.URL, nc.User, nc.Password = ns.url, user, ns.passwords[user]
	conn, err := connect.NATS(nc, user, logger)
	if err != nil {
		t.Fatalf("connect to nats as %s: %v", user, err)
	}
	t.Cleanup(conn.Close)
	checkInboxPrefix(t, conn, user)
	return conn
}

// checkInboxPrefix: a connection with nats.user receives its replies on
// _INBOX_<user>, the only inboxes the configuration lets user read.
func checkInboxPrefix(t *testing.T, nc *nats.Conn, user string) {
	t.Helper()
	if inbox, want := nc.NewInbox(), "_INBOX_"+user+"."; !strings.HasPrefix(inbox, want) {
		t.Fatalf("%s's inbox %s, want one under %s", user, inbox, want)
	}
}

// ---------------------------------------------------------------------------
// NATS: what each user is refused

// TestNATSPermissions provisions the streams and the subscribers' consumers
// as the provisioning identity (`fanout provision`'s calls), checks that
// the relay and each subscriber can do their work with everything
// provisioned (the calls they make with provisioning set to verify), and
// then what each identity is refused.
func TestNATSPermissions(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cfg := loadConfig(t)
	ns := startNATS(t)
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	rel := ns.connect(t, "relay")
	prov := ns.connect(t, "provisioner")
	op := ns.connect(t, "operator")
	// Every subscriber in the registry, each as its own user.
	handlers := map[*natsClient]subscribers.Declaration{}
	client := map[string]*natsClient{}
	for _, d := range registry.Default.All() {
		c := ns.connect(t, d.Name)
		handlers[c], client[d.Name] = d, c
	}
	inv, cin, six := client[invoicing.Name], client[cacheinval.Name], client[searchindex.Name]

	// The provisioner creates EVENTS and DEADLETTER and every subscriber's
	// consumer, and runs again (update) without harm.
	minDup := config.RepublishDelay(cfg.Relay)
	for range 2 {
		if err := relay.EnsureStream(ctx, prov.js, cfg.Stream, minDup, discard); err != nil {
			t.Fatalf("provisioner provisions the stream: %v", err)
		}
		if _, err := subscribers.ProvisionDeadLetterStream(ctx, prov.js, cfg.Subscribers, cfg.Stream.Replicas); err != nil {
			t.Fatalf("provisioner provisions the dead-letter stream: %v", err)
		}
		events, err := prov.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range handlers {
			if _, err := subscribers.ProvisionConsumer(ctx, events, d, cfg.Subscribers, cfg.Stream); err != nil {
				t.Fatalf("provisioner provisions consumer %s: %v", d.Name, err)
			}
		}
	}
	prov.checkClean(t)

	// The relay checks EVENTS (verify) and publishes with PubAcks.
	verify := cfg.Stream
	verify.Provision = "verify"
	if err := relay.EnsureStream(ctx, rel.js, verify, minDup, discard); err != nil {
		t.Fatalf("relay verifies the stream: %v", err)
	}
	publish := func(subject string, id int) uint64 {
		t.Helper()
		msg := nats.NewMsg(subject)
		msg.Data = []byte(`{"order_id": 1, "product_id": 1}`)
		msg.Header.Set(outbox.EventIDHeader, strconv.Itoa(id))
		ack, err := rel.js.PublishMsg(ctx, msg, jetstream.WithMsgID(strconv.Itoa(id)), jetstream.WithExpectStream(cfg.Stream.Name))
		if err != nil {
			t.Fatalf("relay publishes %s: %v", subject, err)
		}
		return ack.Sequence
	}
	orderSeq := publish("events."+shop.OrderCreated, 1)
	productSeq := publish("events.product.updated", 2)

	// Each subscriber looks up the streams and its own consumer, as the
	// runtime does with provisioning set to verify.
	for c, d := range handlers {
		if _, err := c.js.Stream(ctx, cfg.Subscribers.DeadLetterStream); err != nil {
			t.Fatalf("%s looks up the dead-letter stream: %v", c.user, err)
		}
		s, err := c.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatalf("%s looks up the stream: %v", c.user, err)
		}
		if _, err := s.Consumer(ctx, d.Name); err != nil {
			t.Fatalf("%s looks up its consumer: %v", c.user, err)
		}
		c.checkClean(t)
	}
	eventCount := func() uint64 {
		t.Helper()
		info, err := rel.js.Stream(ctx, cfg.Stream.Name) // STREAM.INFO, allowed to the relay
		if err != nil {
			t.Fatal(err)
		}
		return info.CachedInfo().State.Msgs
	}

	t.Run("a subscriber works its own consumer", func(t *testing.T) {
		for _, tc := range []struct {
			c         *natsClient
			name, typ string
			seq       uint64
		}{
			{inv, invoicing.Name, shop.OrderCreated, orderSeq},
			{six, searchindex.Name, "product.updated", productSeq},
		} {
			events, err := tc.c.js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			c, err := events.Consumer(ctx, tc.name)
			if err != nil {
				t.Fatal(err)
			}
			batch, err := c.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			var got []jetstream.Msg
			for m := range batch.Messages() {
				got = append(got, m)
			}
			if len(got) != 1 || got[0].Subject() != "events."+tc.typ {
				t.Fatalf("%s fetched %d messages (%v), want its %s", tc.name, len(got), batch.Error(), tc.typ)
			}
			if err := got[0].InProgress(); err != nil {
				t.Fatal(err)
			}
			if err := got[0].DoubleAck(ctx); err != nil {
				t.Fatalf("%s acks: %v", tc.name, err)
			}
			ack, err := tc.c.js.Publish(ctx, "deadletter."+tc.name+"."+tc.typ, []byte("{}"))
			if err != nil || ack.Stream != cfg.Subscribers.DeadLetterStream {
				t.Fatalf("%s publishes its dead letter: %v", tc.name, err)
			}
			info, err := c.Info(ctx)
			if err != nil || info.AckFloor.Stream != tc.seq || info.NumAckPending != 0 {
				t.Fatalf("%s consumer after the ack: %+v (%v)", tc.name, info, err)
			}
			tc.c.checkClean(t) // none of the above was refused
			// It reads only what its consumer delivers: no event by
			// sequence (the cache invalidator has no business reading
			// orders).
			tc.c.deniedRequest(t, "$JS.API.STREAM.MSG.GET.EVENTS", func(ctx context.Context) error {
				_, err := events.GetMsg(ctx, tc.seq)
				return err
			})
			tc.c.checkClean(t)
		}
	})

	t.Run("a dead letter a subscriber forges is refused", func(t *testing.T) {
		// A subscriber may publish dead letters under its own name only;
		// what it writes in them is up to it. The operator tools take the
		// subscriber from the subject, refuse a letter that says otherwise,
		// and check the event it names against the events stream: a forged
		// letter redriven would write a checkpoint and make a subscriber
		// skip a real event.
		admin := ns.connect(t, "admin")
		dls, err := admin.js.Stream(ctx, cfg.Subscribers.DeadLetterStream)
		if err != nil {
			t.Fatal(err)
		}
		forge := func(c *natsClient, claimed, typ string, seq uint64, id int) *jetstream.RawStreamMsg {
			t.Helper()
			msg := nats.NewMsg("deadletter." + c.user + "." + typ)
			msg.Data = []byte(`{"order_id": 1, "product_id": 1}`)
			msg.Header.Set(subscribers.DeadSubscriberHeader, claimed)
			msg.Header.Set(subscribers.DeadReasonHeader, "forged")
			msg.Header.Set(outbox.EventIDHeader, strconv.Itoa(id))
			msg.Header.Set(subscribers.DeadSubjectHeader, "events."+typ)
			msg.Header.Set(subscribers.DeadStreamSeqHeader, strconv.FormatUint(seq, 10))
			ack, err := c.js.PublishMsg(ctx, msg)
			if err != nil {
				t.Fatalf("%s publishes a letter under its own name: %v", c.user, err)
			}
			m, err := dls.GetMsg(ctx, ack.Sequence)
			if err != nil {
				t.Fatal(err)
			}
			return m
		}
		refused := func(c *natsClient, what string, err error) {
			t.Helper()
			if !errors.Is(err, subscribers.ErrDeadLetterRefused) {
				t.Errorf("%s: %s: accepted (%v)", c.user, what, err)
				return
			}
			t.Logf("refused: %s, %s: %v", c.user, what, err)
		}
		for c, d := range handlers {
			other := invoicing.Name
			if c == inv {
				other = cacheinval.Name
			}
			// Speaking for another subscriber.
			_, err := subscribers.ParseDeadLetter(forge(c, other, shop.OrderCreated, orderSeq, 1), cfg.Subscribers, cfg.Stream)
			refused(c, "a letter claiming to be "+other+"'s", err)

			// In its own name, but naming an event that is not the one at
			// the sequence given, or one it does not receive.
			wrongID, typ := 2, shop.OrderCreated // the order's sequence holds event 1
			if !slices.Contains(d.EventTypes, shop.OrderCreated) {
				wrongID = 1 // the order event itself, which it never receives
			}
			dl, err := subscribers.ParseDeadLetter(forge(c, c.user, typ, orderSeq, wrongID), cfg.Subscribers, cfg.Stream)
			if err != nil {
				t.Fatalf("%s: a letter in its own name: %v", c.user, err)
			}
			refused(c, "a letter naming an event that is not its own", dl.Verify(ctx, admin.js, cfg.Stream))
		}
		// A letter that agrees with itself and with the stream is read.
		dl, err := subscribers.ParseDeadLetter(forge(inv, inv.user, shop.OrderCreated, orderSeq, 1), cfg.Subscribers, cfg.Stream)
		if err != nil {
			t.Fatal(err)
		}
		if err := dl.Verify(ctx, admin.js, cfg.Stream); err != nil || !dl.Verified || dl.Event.ID != 1 {
			t.Errorf("a true letter: %v (verified %v, event %d)", err, dl.Verified, dl.Event.ID)
		}
	})

	t.Run("a reindex replays the stream as the operator, not as the search indexer", func(t *testing.T) {
		var got []subscribers.Event
		read, pos, err := searchindex.ReadEvents(ctx, op.js, cfg.Stream, 0, productSeq, func(evs []subscribers.Event) error {
			got = append(got, evs...)
			return nil
		})
		if err != nil {
			t.Fatalf("the operator replays: %v", err)
		}
		if read != 1 || len(got) != 1 || got[0].ID != 2 || got[0].Type != "product.updated" || pos != productSeq {
			t.Fatalf("replay read %d events %+v up to %d; want the product event (id 2, seq %d) only", read, got, pos, productSeq)
		}
		events, err := op.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := events.Consumer(ctx, searchindex.ReplayConsumer); !errors.Is(err, jetstream.ErrConsumerNotFound) {
			t.Errorf("replay consumer after the replay: %v, want it deleted", err)
		}
		op.checkClean(t)
		// A replay consumer could carry any filter, so no subscriber may
		// create one: it would read events that are not its own.
		for _, c := range []*natsClient{six, inv} {
			cEvents, err := c.js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			c.deniedRequest(t, "$JS.API.CONSUMER.CREATE.EVENTS."+searchindex.ReplayConsumer, func(ctx context.Context) error {
				_, err := cEvents.CreateConsumer(ctx, jetstream.ConsumerConfig{Name: searchindex.ReplayConsumer, AckPolicy: jetstream.AckNonePolicy})
				return err
			})
			c.checkClean(t)
		}
	})

	t.Run("each identity is refused what it must not do", func(t *testing.T) {
		// One refusal per API each identity must not reach, each logged.
		type refusal struct {
			what, subject string
			op            func(ctx context.Context, c *natsClient) error
		}
		raw := func(subject, body string) func(ctx context.Context, c *natsClient) error {
			return func(ctx context.Context, c *natsClient) error {
				_, err := c.nc.RequestWithContext(ctx, subject, []byte(body))
				return err
			}
		}
		update := func(name string) refusal {
			return refusal{"change stream " + name, "$JS.API.STREAM.UPDATE." + name, func(ctx context.Context, c *natsClient) error {
				sc := relay.StreamConfig(cfg.Stream)
				if name == cfg.Subscribers.DeadLetterStream {
					sc = subscribers.DeadLetterStreamConfig(cfg.Subscribers, cfg.Stream.Replicas)
				}
				sc.MaxAge = time.Minute
				_, err := c.js.UpdateStream(ctx, sc)
				return err
			}}
		}
		create := func(name string) refusal {
			return refusal{"create stream " + name + "2", "$JS.API.STREAM.CREATE." + name + "2", raw("$JS.API.STREAM.CREATE."+name+"2", `{"name":"`+name+`2","subjects":["x.`+name+`"]}`)}
		}
		purge := func(name string) refusal {
			return refusal{"purge stream " + name, "$JS.API.STREAM.PURGE." + name, raw("$JS.API.STREAM.PURGE."+name, `{}`)}
		}
		deleteStream := func(name string) refusal {
			return refusal{"delete stream " + name, "$JS.API.STREAM.DELETE." + name, raw("$JS.API.STREAM.DELETE."+name, ``)}
		}
		deleteMsg := func(name string) refusal {
			return refusal{"delete a message of " + name, "$JS.API.STREAM.MSG.DELETE." + name, raw("$JS.API.STREAM.MSG.DELETE."+name, `{"seq":1}`)}
		}
		getMsg := func(name string) refusal {
			return refusal{"read a message of " + name + " by sequence", "$JS.API.STREAM.MSG.GET." + name, raw("$JS.API.STREAM.MSG.GET."+name, `{"seq":1}`)}
		}
		publishTo := func(subject string) refusal {
			return refusal{"publish to " + subject, subject, func(ctx context.Context, c *natsClient) error {
				_, err := c.js.Publish(ctx, subject, []byte(`{}`))
				return err
			}}
		}
		consumerCreate := func(name string, filter string) refusal {
			subject := "$JS.API.CONSUMER.CREATE.EVENTS." + name
			if filter != "" {
				subject += "." + filter
			}
			return refusal{"create or change consumer " + name + " (filter " + filter + ")", subject, func(ctx context.Context, c *natsClient) error {
				cc := jetstream.ConsumerConfig{Durable: name, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: filter}
				_, err := c.js.CreateOrUpdateConsumer(ctx, cfg.Stream.Name, cc)
				return err
			}}
		}
		consumerDelete := func(name string) refusal {
			return refusal{"delete consumer " + name, "$JS.API.CONSUMER.DELETE.EVENTS." + name, raw("$JS.API.CONSUMER.DELETE.EVENTS."+name, ``)}
		}
		common := func() []refusal {
			return []refusal{
				update(cfg.Stream.Name), update(cfg.Subscribers.DeadLetterStream), create(cfg.Stream.Name),
				purge(cfg.Stream.Name), purge(cfg.Subscribers.DeadLetterStream),
				deleteStream(cfg.Stream.Name), deleteStream(cfg.Subscribers.DeadLetterStream),
				deleteMsg(cfg.Stream.Name), deleteMsg(cfg.Subscribers.DeadLetterStream),
			}
		}
		byUser := map[*natsClient][]refusal{}
		byUser[rel] = append(common(), getMsg(cfg.Stream.Name), consumerCreate("snoop", ""), publishTo("deadletter.invoicing.x"))
		for c, d := range handlers {
			name := d.Name
			byUser[c] = append(common(), getMsg(cfg.Stream.Name), getMsg(cfg.Subscribers.DeadLetterStream),
				// Not even its own consumer: it could widen its filter.
				consumerCreate(name, ""), consumerCreate(name, "events.>"), consumerDelete(name),
				publishTo("events."+shop.OrderCreated))
		}
		byUser[prov] = []refusal{
			purge(cfg.Stream.Name), purge(cfg.Subscribers.DeadLetterStream),
			deleteStream(cfg.Stream.Name), deleteStream(cfg.Subscribers.DeadLetterStream),
			deleteMsg(cfg.Stream.Name), deleteMsg(cfg.Subscribers.DeadLetterStream),
			getMsg(cfg.Stream.Name), getMsg(cfg.Subscribers.DeadLetterStream), consumerDelete(invoicing.Name),
			{"pull from consumer invoicing", "$JS.API.CONSUMER.MSG.NEXT.EVENTS." + invoicing.Name, raw("$JS.API.CONSUMER.MSG.NEXT.EVENTS."+invoicing.Name, `{"batch":1}`)},
			publishTo("events." + shop.OrderCreated), publishTo("deadletter.invoicing.x"),
		}
		byUser[op] = append(common(), publishTo("events."+shop.OrderCreated), publishTo("deadletter.invoicing.x"))
		for _, c := range append([]*natsClient{rel, prov, op}, slices.Collect(maps.Keys(handlers))...) {
			for _, r := range byUser[c] {
				c.deniedRequest(t, r.subject, func(ctx context.Context) error { return r.op(ctx, c) })
				t.Logf("refused: %-11s %s (%s)", c.user, r.what, r.subject)
			}
			c.checkClean(t)
		}
		// Not even the administrator may remove events or dead letters: the
		// streams themselves deny it.
		admin := ns.connect(t, "admin")
		for _, name := range []string{cfg.Stream.Name, cfg.Subscribers.DeadLetterStream} {
			s, err := admin.js.Stream(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Purge(ctx); err == nil {
				t.Errorf("admin purged %s", name)
			} else {
				t.Logf("refused: %-11s purge stream %s (the stream denies it: %v)", "admin", name, err)
			}
			if err := s.DeleteMsg(ctx, 1); err == nil {
				t.Errorf("admin deleted a message of %s", name)
			} else {
				t.Logf("refused: %-11s delete a message of %s (the stream denies it: %v)", "admin", name, err)
			}
		}
	})

	t.Run("a subscriber cannot publish events", func(t *testing.T) {
		before := eventCount()
		subject := "events." + shop.OrderCreated
		if err := inv.nc.Publish(subject, []byte(`{"order_id": 666}`)); err != nil {
			t.Fatal(err)
		}
		inv.waitViolation(t, "Publish", subject)
		inv.deniedRequest(t, subject, func(ctx context.Context) error {
			_, err := inv.js.Publish(ctx, subject, []byte(`{"order_id": 667}`))
			return err
		})
		for _, c := range []*natsClient{cin, six} {
			c.deniedRequest(t, "events.product.updated", func(ctx context.Context) error {
				_, err := c.js.Publish(ctx, "events.product.updated", []byte(`{"product_id": 1}`))
				return err
			})
		}
		if after := eventCount(); after != before {
			t.Errorf("stream %s went from %d to %d messages", cfg.Stream.Name, before, after)
		}
	})

	t.Run("a subscriber cannot touch another subscriber's consumer", func(t *testing.T) {
		other := "cacheinval"
		for _, c := range []*natsClient{inv, six} {
			events, err := c.js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			c.deniedRequest(t, "$JS.API.CONSUMER.INFO.EVENTS."+other, func(ctx context.Context) error {
				_, err := events.Consumer(ctx, other)
				return err
			})
			c.deniedRequest(t, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+other, func(ctx context.Context) error {
				_, err := c.nc.RequestWithContext(ctx, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+other, []byte(`{"batch":1}`))
				return err
			})
			c.deniedRequest(t, "$JS.API.CONSUMER.CREATE.EVENTS."+other, func(ctx context.Context) error {
				_, err := events.CreateOrUpdateConsumer(ctx, subscribers.ConsumerConfig(cacheinval.Name, cacheinval.Subscriber.EventTypes, cfg.Subscribers, cfg.Stream))
				return err
			})
			c.deniedRequest(t, "$JS.API.CONSUMER.DELETE.EVENTS."+other, func(ctx context.Context) error {
				return events.DeleteConsumer(ctx, other)
			})
			c.deniedRequest(t, "deadletter.cacheinval.product.updated", func(ctx context.Context) error {
				_, err := c.js.Publish(ctx, "deadletter.cacheinval.product.updated", []byte("{}"))
				return err
			})
			ackSubject := "$JS.ACK.EVENTS." + other + ".1.2.2.1700000000000000000.0"
			if err := c.nc.Publish(ackSubject, []byte("+ACK")); err != nil {
				t.Fatal(err)
			}
			c.waitViolation(t, "Publish", ackSubject)
			advisory := "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.EVENTS." + other
			sub, err := c.nc.Subscribe(advisory, func(*nats.Msg) {})
			if err != nil {
				t.Fatal(err)
			}
			c.waitViolation(t, "Subscription", advisory)
			_ = sub.Unsubscribe()
			c.deniedRequest(t, "$JS.API.STREAM.DELETE.EVENTS", func(ctx context.Context) error {
				return c.js.DeleteStream(ctx, cfg.Stream.Name)
			})
			c.checkClean(t)
		}
		// cacheinval's consumer delivered nothing to anyone.
		s, err := cin.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatal(err)
		}
		c, err := s.Consumer(ctx, other)
		if err != nil {
			t.Fatal(err)
		}
		if ci := c.CachedInfo(); ci.Delivered.Consumer != 0 || ci.NumPending != 1 {
			t.Errorf("cacheinval consumer: delivered %d, pending %d; want 0 and 1", ci.Delivered.Consumer, ci.NumPending)
		}
		cin.checkClean(t)
	})

	t.Run("no user can read or forge another user's replies", func(t *testing.T) {
		users := maps.Clone(client)
		users["relay"] = rel
		// request makes user receive a reply (a JetStream API response) on
		// its inbox.
		request := func(user string) {
			t.Helper()
			if _, err := users[user].js.Stream(ctx, cfg.Stream.Name); err != nil {
				t.Fatalf("%s looks up the stream: %v", user, err)
			}
		}
		// The replies really travel on _INBOX_<user>: the admin, who may
		// subscribe to anything, sees invoicing's.
		admin := ns.connect(t, "admin")
		seen := make(chan *nats.Msg, 100)
		spy, err := admin.nc.ChanSubscribe("_INBOX_invoicing.>", seen)
		if err != nil {
			t.Fatal(err)
		}
		if err := admin.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		request("invoicing")
		select {
		case m := <-seen:
			if !strings.HasPrefix(m.Subject, "_INBOX_invoicing.") {
				t.Errorf("admin's subscription to _INBOX_invoicing.> got %s", m.Subject)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("invoicing's reply did not travel on _INBOX_invoicing.")
		}
		_ = spy.Unsubscribe()

		// No other user may subscribe there, nor to the default inboxes,
		// nor publish (forge a reply) there.
		for user, c := range users {
			snooped := make(chan *nats.Msg, 100)
			subjects := []string{"_INBOX.>", ">"}
			for other := range users {
				if other != user {
					subjects = append(subjects, "_INBOX_"+other+".>")
				}
			}
			for _, subject := range subjects {
				sub, err := c.nc.ChanSubscribe(subject, snooped)
				if err != nil {
					t.Fatal(err)
				}
				defer sub.Unsubscribe() //nolint:errcheck
				c.waitViolation(t, "Subscription", subject)
			}
			for other := range users {
				if other == user {
					continue
				}
				request(other)
				forged := "_INBOX_" + other + ".forged"
				if err := c.nc.Publish(forged, []byte(`{"type":"io.nats.jetstream.api.v1.stream_info_response"}`)); err != nil {
					t.Fatal(err)
				}
				c.waitViolation(t, "Publish", forged)
			}
			if err := c.nc.Flush(); err != nil {
				t.Fatal(err)
			}
			select {
			case m := <-snooped:
				t.Errorf("%s read %s", user, m.Subject)
			default:
			}
			c.checkClean(t)
		}
	})

	t.Run("the relay cannot consume", func(t *testing.T) {
		for _, name := range registry.Default.Names() {
			rel.deniedRequest(t, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+name, func(ctx context.Context) error {
				_, err := rel.nc.RequestWithContext(ctx, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+name, []byte(`{"batch":1}`))
				return err
			})
			rel.deniedRequest(t, "$JS.API.CONSUMER.INFO.EVENTS."+name, func(ctx context.Context) error {
				_, err := rel.js.Consumer(ctx, cfg.Stream.Name, name)
				return err
			})
		}
		rel.deniedRequest(t, "$JS.API.CONSUMER.CREATE.EVENTS.snoop", func(ctx context.Context) error {
			_, err := rel.js.CreateConsumer(ctx, cfg.Stream.Name, jetstream.ConsumerConfig{Durable: "snoop", AckPolicy: jetstream.AckExplicitPolicy})
			return err
		})
		s, err := rel.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatal(err)
		}
		rel.deniedRequest(t, "$JS.API.STREAM.MSG.GET.EVENTS", func(ctx context.Context) error {
			_, err := s.GetMsg(ctx, orderSeq)
			return err
		})
		rel.deniedRequest(t, "$JS.API.STREAM.DELETE.EVENTS", func(ctx context.Context) error {
			return rel.js.DeleteStream(ctx, cfg.Stream.Name)
		})
		sub, err := rel.nc.Subscribe("events.>", func(*nats.Msg) {})
		if err != nil {
			t.Fatal(err)
		}
		rel.waitViolation(t, "Subscription", "events.>")
		_ = sub.Unsubscribe()
		if err := rel.nc.Publish("deadletter.invoicing.x", nil); err != nil {
			t.Fatal(err)
		}
		rel.waitViolation(t, "Publish", "deadletter.invoicing.x")
		rel.checkClean(t)
	})

	t.Run("wrong or missing credentials are refused", func(t *testing.T) {
		for _, opts := range [][]nats.Option{
			{nats.UserInfo("relay", ns.passwords["invoicing"])},
			{nats.UserInfo("relay", "")},
			{},
		} {
			nc, err := nats.Connect(ns.url, append(opts, nats.Timeout(5*time.Second))...)
			if err == nil {
				nc.Close()
				t.Error("connected with wrong credentials")
			} else if !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
				t.Errorf("wrong credentials: got %v, want an authorization violation", err)
			}
		}
	})
}

// TestNATSConfigNeedsItsSecrets: the configuration names its secrets only by
// environment variable, and the server refuses to start without them.
func TestNATSConfigNeedsItsSecrets(t *testing.T) {
	t.Parallel()
	bin, err := repo.Bin("nats-server")
	if err != nil {
		t.Fatal(err)
	}
	conf := natsConfPath(t)
	body, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	vars := []string{"FANOUT_NATS_STORE_DIR"}
	for _, u := range natsUsers {
		v := "FANOUT_NATS_" + strings.ToUpper(u) + "_PASSWORD"
		vars = append(vars, v)
		if !strings.Contains(string(body), "password: $"+v) {
			t.Errorf("%s does not take user %s's password from $%s", conf, u, v)
		}
	}
	var base []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FANOUT_NATS_") {
			base = append(base, kv)
		}
	}
	check := func(env []string) (string, error) {
		cmd := exec.Command(bin, "-c", conf, "-t")
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	all := append([]string(nil), base...)
	for _, v := range vars {
		all = append(all, v+"=x"+v)
	}
	if out, err := check(all); err != nil {
		t.Fatalf("nats-server -t with every variable set: %v\n%s", err, out)
	}
	for i, missing := range vars {
		env := append([]string(nil), base...)
		for j, v := range vars {
			if j != i {
				env = append(env, v+"=x"+v)
			}
		}
		out, err := check(env)
		if err == nil || !strings.Contains(out, missing) {
			t.Errorf("nats-server -t without %s: %v, %q; want a refusal naming it", missing, err, out)
		}
	}
}

// ---------------------------------------------------------------------------
// PostgreSQL: what each role is refused

// TestPostgresRoles checks roles.sql's grants: it converges when run twice,
// sets passwords from the environment only, and each role can do its work
// and nothing else.
func TestPostgresRoles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := loadConfig(t)
	db := pgtest.NewDB(t)
	// A password from the environment (a SCRAM verifier has a fresh salt
	// each time it is set, so the stored one changes), and none from a run
	// without the variable.
	rolpassword := func() string {
		t.Helper()
		var pw *string
		if err := db.Pool.QueryRow(ctx, `SELECT rolpassword FROM pg_authid WHERE rolname = 'fanout_searchindex'`).Scan(&pw); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		if pw == nil {
			return ""
		}
		return *pw
	}
	t.Cleanup(func() {
		withRolesLock(t, func(c *pgx.Conn) error {
			_, err := c.Exec(context.Background(), "ALTER ROLE fanout_searchindex PASSWORD NULL")
			return err
		})
	})
	before := rolpassword()
	password := "pw" + randomHex(t, 12)
	out := applyRoles(t, db.URL, "FANOUT_PG_SEARCHINDEX_PASSWORD="+password)
	if strings.Contains(out, password) {
		t.Errorf("psql printed the password: %s", out)
	}
	set := rolpassword()
	if !strings.HasPrefix(set, "SCRAM-SHA-256$") || set == before {
		t.Errorf("fanout_searchindex's password after a run with FANOUT_PG_SEARCHINDEX_PASSWORD: %q, before %q; want a new SCRAM verifier", set, before)
	}
	first := privileges(t, db.Pool)
	applyRoles(t, db.URL)
	if second := privileges(t, db.Pool); second != first {
		t.Errorf("a second run changed the privileges:\nfirst:\n%s\nsecond:\n%s", first, second)
	}
	if again := rolpassword(); again != set {
		t.Errorf("a run without FANOUT_PG_SEARCHINDEX_PASSWORD changed the password")
	}
	for _, want := range []string{
		"outbox owner=fanout_migrate",
		"outbox fanout_relay=dr",
		"outbox.status fanout_relay=w",
		"outbox.payload fanout_writer=a",
		"outbox.id fanout_writer=r",
		"invoices fanout_invoicing=a",
		"invoices.order_id fanout_invoicing=r",
		"products fanout_cacheinval=r",
		"processed_events fanout_invoicing=dar",
		"policy fanout_invoicing_checkpoints (subscriber = 'invoicing'::text) (subscriber = 'invoicing'::text)",
	} {
		if !strings.Contains(first, want+"\n") {
			t.Errorf("privileges lack %q:\n%s", want, first)
		}
	}

	// Seed a catalog and order as the superuser (the business application).
	var productID, orderID int64
	err := db.Pool.QueryRow(ctx, `
WITH b AS (INSERT INTO brands (name) VALUES ('Acme') RETURNING id),
     c AS (INSERT INTO categories (name) VALUES ('phones') RETURNING id),
     p AS (INSERT INTO products (sku, name, brand_id, category_id, price)
           SELECT 'SKU-1', 'Phone', b.id, c.id, 10.00 FROM b, c RETURNING id),
     i AS (INSERT INTO inventory (product_id, stock) SELECT id, 5 FROM p)
SELECT id FROM p`).Scan(&productID)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `INSERT INTO orders (customer) VALUES ('ada') RETURNING id`).Scan(&orderID); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO order_lines (order_id, line_no, product_id, quantity, unit_price) VALUES ($1, 1, $2, 1, 10.00)`, orderID, productID); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id) VALUES ('cacheinval', 7), ('invoicing', 8)`); err != nil {
		t.Fatal(err)
	}

	t.Run("fanout_writer", func(t *testing.T) {
		asRole(t, db.Pool, "fanout_writer", func(tx pgx.Tx) {
			if _, err := outbox.Write(ctx, tx, orderEvent(orderID)); err != nil {
				t.Errorf("outbox.Write as fanout_writer: %v", err)
			}
		})
		for _, sql := range []string{
			`SELECT payload FROM outbox`,
			`UPDATE outbox SET status = 'sent'`,
			`DELETE FROM outbox`,
			`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status) VALUES ('x', '1', 'x.y', '{}', 'sent')`,
			`INSERT INTO orders (customer) VALUES ('eve')`,
		} {
			asRole(t, db.Pool, "fanout_writer", func(tx pgx.Tx) { denied(t, tx, "fanout_writer", sql) })
		}
	})

	t.Run("fanout_invoicing", func(t *testing.T) {
		pool := rolePool(t, cfg, db.URL, "fanout_invoicing")
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			ev := subscribers.Event{ID: 100, Type: shop.OrderCreated, Payload: []byte(fmt.Sprintf(`{"order_id": %d}`, orderID))}
			if _, err := tx.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id) VALUES ('invoicing', 100)`); err != nil {
				return err
			}
			return invoicing.New().HandleTx(ctx, tx, ev)
		})
		if err != nil {
			t.Fatalf("invoicing's work as fanout_invoicing: %v", err)
		}
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = $1`, orderID).Scan(&n); err != nil || n != 1 {
			t.Fatalf("invoices for order %d: %d (%v)", orderID, n, err)
		}
		// Its own checkpoint rows only: cacheinval's are invisible and out
		// of reach.
		rows, err := pool.Query(ctx, `SELECT DISTINCT subscriber FROM processed_events`)
		if err != nil {
			t.Fatal(err)
		}
		visible, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(visible) != 1 || visible[0] != "invoicing" {
			t.Errorf("fanout_invoicing sees checkpoints of %v (%v), want only invoicing", visible, err)
		}
		if ct, err := pool.Exec(ctx, `DELETE FROM processed_events WHERE subscriber = 'cacheinval'`); err != nil || ct.RowsAffected() != 0 {
			t.Errorf("fanout_invoicing deleted %d of cacheinval's checkpoints (%v)", ct.RowsAffected(), err)
		}
		denied(t, pool, "fanout_invoicing", `INSERT INTO processed_events (subscriber, event_id) VALUES ('cacheinval', 9)`)
		denied(t, pool, "fanout_invoicing", `UPDATE outbox SET status = 'pending'`)
		denied(t, pool, "fanout_invoicing", `SELECT * FROM outbox`)
		denied(t, pool, "fanout_invoicing", `SELECT * FROM brands`)
		denied(t, pool, "fanout_invoicing", `UPDATE invoices SET total = 0`)
		denied(t, pool, "fanout_invoicing", `DELETE FROM invoices`)
		denied(t, pool, "fanout_invoicing", `SELECT total FROM invoices`)
	})

	t.Run("fanout_salesledger", func(t *testing.T) {
		pool := rolePool(t, cfg, db.URL, "fanout_salesledger")
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			ev := subscribers.Event{ID: 101, Type: shop.OrderCreated, Payload: []byte(fmt.Sprintf(`{"order_id": %d}`, orderID))}
			if _, err := tx.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id) VALUES ('salesledger', 101)`); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO subscriber_attempts (subscriber, event_id, failures) VALUES ('salesledger', 101, 1)`); err != nil {
				return err
			}
			return salesledger.New().HandleTx(ctx, tx, ev)
		})
		if err != nil {
			t.Fatalf("the sales ledger's work as fanout_salesledger: %v", err)
		}
		var units int64
		if err := db.Pool.QueryRow(ctx, `SELECT units FROM product_sales WHERE product_id = $1`, productID).Scan(&units); err != nil || units != 1 {
			t.Fatalf("ledger of product %d: %d units (%v), want 1", productID, units, err)
		}
		denied(t, pool, "fanout_salesledger", `INSERT INTO processed_events (subscriber, event_id) VALUES ('invoicing', 9)`)
		denied(t, pool, "fanout_salesledger", `INSERT INTO subscriber_attempts (subscriber, event_id) VALUES ('invoicing', 9)`)
		denied(t, pool, "fanout_salesledger", `DELETE FROM product_sales`)
		denied(t, pool, "fanout_salesledger", `SELECT * FROM products`)
		denied(t, pool, "fanout_salesledger", `SELECT * FROM outbox`)
		denied(t, pool, "fanout_salesledger", `INSERT INTO invoices (order_id, number, total) VALUES (1, 'x', 0)`)
	})

	t.Run("fanout_operator", func(t *testing.T) {
		pool := rolePool(t, cfg, db.URL, "fanout_operator")
		// What the operator commands run: status's counts (every
		// subscriber's checkpoint, through its memberships), retry-failed,
		// the audit trail, a reindex's reads of the catalog, and a
		// redrive's work as a subscriber.
		var outboxRows, checkpoints int64
		if err := pool.QueryRow(ctx, metrics.OutboxStateSQL).Scan(&outboxRows, new(float64), new(int64)); err != nil {
			t.Errorf("fanout_operator reads the outbox state: %v", err)
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_events`).Scan(&checkpoints); err != nil || checkpoints < 2 {
			t.Errorf("fanout_operator reads the checkpoints: %d rows (%v), want every subscriber's", checkpoints, err)
		}
		if _, err := pool.Exec(ctx, `UPDATE outbox SET status = 'pending', attempts = 0, available_at = now() WHERE status = 'failed'`); err != nil {
			t.Errorf("fanout_operator returns failed rows to pending: %v", err)
		}
		if _, err := pool.Exec(ctx, `INSERT INTO dead_letter_actions (action, subscriber, stream_seq, outcome, actor) VALUES ('discard', 'invoicing', 1, 'discarded', 'test')`); err != nil {
			t.Errorf("fanout_operator records an action: %v", err)
		}
		if _, err := shop.LoadProducts(ctx, pool, []int64{productID}); err != nil {
			t.Errorf("fanout_operator reads the catalog: %v", err)
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id) VALUES ('invoicing', 102)`); err != nil {
				return err
			}
			return invoicing.New().HandleTx(ctx, tx, subscribers.Event{ID: 102, Type: shop.OrderCreated, Payload: []byte(fmt.Sprintf(`{"order_id": %d}`, orderID))})
		})
		if err != nil {
			t.Errorf("fanout_operator redrives as invoicing: %v", err)
		}
		denied(t, pool, "fanout_operator", `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('x', '1', 'x.y', '{}')`)
		denied(t, pool, "fanout_operator", `UPDATE outbox SET payload = '{}'`)
		denied(t, pool, "fanout_operator", `DELETE FROM outbox`)
		denied(t, pool, "fanout_operator", `UPDATE dead_letter_actions SET outcome = 'handled'`)
		denied(t, pool, "fanout_operator", `DELETE FROM dead_letter_actions`)
		denied(t, pool, "fanout_operator", `UPDATE products SET price = 0`)
		denied(t, pool, "fanout_operator", `CREATE TABLE sneaky (id int)`)
	})

	for _, role := range []string{"fanout_cacheinval", "fanout_searchindex"} {
		t.Run(role, func(t *testing.T) {
			pool := rolePool(t, cfg, db.URL, role)
			got, err := shop.LoadProducts(ctx, pool, []int64{productID})
			if err != nil || len(got) != 1 {
				t.Fatalf("%s reads the catalog (shop.LoadProducts): %d products, %v", role, len(got), err)
			}
			subscriber := strings.TrimPrefix(role, "fanout_")
			if _, err := pool.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id) VALUES ($1, 1) ON CONFLICT DO NOTHING`, subscriber); err != nil {
				t.Errorf("%s checkpoints: %v", role, err)
			}
			denied(t, pool, role, `INSERT INTO processed_events (subscriber, event_id) VALUES ('invoicing', 1)`)
			denied(t, pool, role, `UPDATE products SET price = 0`)
			denied(t, pool, role, `SELECT * FROM orders`)
			denied(t, pool, role, `SELECT * FROM outbox`)
			denied(t, pool, role, `INSERT INTO invoices (order_id, number, total) VALUES (1, 'x', 0)`)
		})
	}

	// Every subscriber in the registry has its role, with its own
	// checkpoints and attempts and its declared grants, and nothing of
	// another subscriber's.
	for _, d := range registry.Default.All() {
		role := "fanout_" + d.Name
		t.Run(role+" as declared", func(t *testing.T) {
			pool := rolePool(t, cfg, db.URL, role)
			asRole(t, db.Pool, role, func(tx pgx.Tx) {
				if _, err := tx.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id) VALUES ($1, 9001)`, d.Name); err != nil {
					t.Errorf("%s checkpoints: %v", role, err)
				}
				if _, err := tx.Exec(ctx, `INSERT INTO subscriber_attempts (subscriber, event_id, failures) VALUES ($1, 9001, 1)`, d.Name); err != nil {
					t.Errorf("%s records an attempt: %v", role, err)
				}
			})
			other := invoicing.Name
			if d.Name == other {
				other = cacheinval.Name
			}
			denied(t, pool, role, `INSERT INTO processed_events (subscriber, event_id) VALUES ($1, 9002)`, other)
			denied(t, pool, role, `INSERT INTO subscriber_attempts (subscriber, event_id) VALUES ($1, 9002)`, other)
			denied(t, pool, role, `SELECT * FROM outbox`)
			denied(t, pool, role, `SELECT * FROM dead_letter_actions`)
			for _, g := range d.Grants {
				checkGrant(t, db.Pool, role, g)
			}
		})
	}

	t.Run("fanout_relay", func(t *testing.T) {
		pool := rolePool(t, cfg, db.URL, "fanout_relay")
		denied(t, pool, "fanout_relay", `SELECT * FROM products`)
		denied(t, pool, "fanout_relay", `UPDATE products SET price = 0`)
		denied(t, pool, "fanout_relay", `UPDATE outbox SET event_type = 'x.y'`)
		denied(t, pool, "fanout_relay", `DELETE FROM processed_events`)
	})
}

// checkGrant checks that role holds grant, written as in a declaration's
// Grants ("SELECT, INSERT ON a, b", "SELECT (id, x) ON t", "USAGE ON
// SEQUENCE s").
func checkGrant(t *testing.T, pool *pgxpool.Pool, role, grant string) {
	t.Helper()
	privs, objects, ok := strings.Cut(grant, " ON ")
	if !ok {
		t.Fatalf("grant %q: no ON", grant)
	}
	var columns []string
	if open := strings.Index(privs, "("); open >= 0 {
		columns = strings.Split(strings.Trim(privs[open:], "() "), ",")
		privs = privs[:open]
	}
	check := `SELECT has_table_privilege($1, $2, $3)`
	if rest, seq := strings.CutPrefix(objects, "SEQUENCE "); seq {
		objects, check = rest, `SELECT has_sequence_privilege($1, $2, $3)`
	}
	for _, object := range strings.Split(objects, ",") {
		for _, priv := range strings.Split(privs, ",") {
			object, priv := strings.TrimSpace(object), strings.TrimSpace(priv)
			if len(columns) > 0 {
				for _, col := range columns {
					var has bool
					if err := pool.QueryRow(context.Background(), `SELECT has_column_privilege($1, $2, $3, $4)`,
						role, object, strings.TrimSpace(col), priv).Scan(&has); err != nil || !has {
						t.Errorf("%s: %s on %s.%s: %v (%v), declared %q", role, priv, object, col, has, err, grant)
					}
				}
				continue
			}
			var has bool
			if err := pool.QueryRow(context.Background(), check, role, object, priv).Scan(&has); err != nil || !has {
				t.Errorf("%s: %s on %s: %v (%v), declared %q", role, priv, object, has, err, grant)
			}
		}
	}
}

// privileges lists, one per line, the owner and grants of every table and
// sequence in schema public, their column grants and the policies.
func privileges(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
SELECT line FROM (
    SELECT c.relname || ' owner=' || pg_get_userbyid(c.relowner) AS line
    FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'S')
    UNION ALL
    SELECT c.relname || ' ' || pg_get_userbyid(a.grantee) || '=' || string_agg(
             CASE a.privilege_type WHEN 'SELECT' THEN 'r' WHEN 'INSERT' THEN 'a' WHEN 'UPDATE' THEN 'w'
                                   WHEN 'DELETE' THEN 'd' WHEN 'USAGE' THEN 'U' ELSE a.privilege_type END, '' ORDER BY a.privilege_type)
    FROM pg_class c, aclexplode(c.relacl) a
    WHERE c.relnamespace = 'public'::regnamespace AND a.grantee <> c.relowner
    GROUP BY c.relname, a.grantee
    UNION ALL
    SELECT c.relname || '.' || att.attname || ' ' || pg_get_userbyid(a.grantee) || '=' || string_agg(
             CASE a.privilege_type WHEN 'SELECT' THEN 'r' WHEN 'INSERT' THEN 'a' WHEN 'UPDATE' THEN 'w' ELSE a.privilege_type END, '' ORDER BY a.privilege_type)
    FROM pg_class c JOIN pg_attribute att ON att.attrelid = c.oid, aclexplode(att.attacl) a
    WHERE c.relnamespace = 'public'::regnamespace
    GROUP BY c.relname, att.attname, a.grantee
    UNION ALL
    SELECT 'policy ' || polname || ' ' || pg_get_expr(polqual, polrelid) || ' ' || pg_get_expr(polwithcheck, polrelid)
    FROM pg_policy
) l ORDER BY line`)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(l)
		b.WriteByte('\n')
	}
	return b.String()
}

// TestPostgresRolesBootstrap follows roles.sql's own instructions on an empty
// database: run it, migrate as fanout_migrate, run it again.
func TestPostgresRolesBootstrap(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := loadConfig(t)
	admin, err := pgx.Connect(ctx, pgtest.AdminURL())
	if err != nil {
		t.Fatalf("postgres not reachable (start it with deploy/services.sh up): %v", err)
	}
	defer admin.Close(context.Background())
	name := "fanout_test_roles_" + randomHex(t, 6)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), pgtest.AdminURL())
		if err != nil {
			return
		}
		defer c.Close(context.Background())
		_, _ = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	u, err := url.Parse(pgtest.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	dbURL := u.String()

	out := applyRoles(t, dbURL)
	if !strings.Contains(out, "not all there yet") {
		t.Errorf("roles.sql on an empty database did not say it skipped the table grants: %q", out)
	}
	migratePool := rolePool(t, cfg, dbURL, "fanout_migrate")
	applied, err := schema.Migrate(ctx, migratePool, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil || len(applied) == 0 {
		t.Fatalf("migrate as fanout_migrate: %v (applied %v)", err, applied)
	}
	// Before the second run, nobody but the owner can read the outbox.
	relayPool := rolePool(t, cfg, dbURL, "fanout_relay")
	denied(t, relayPool, "fanout_relay before the grants", `SELECT id FROM outbox`)

	applyRoles(t, dbURL)
	if _, err := relayPool.Exec(ctx, `SELECT id FROM outbox`); err != nil {
		t.Errorf("fanout_relay after the grants: %v", err)
	}
	var owner string
	if err := migratePool.QueryRow(ctx, `SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = 'public.outbox'::regclass`).Scan(&owner); err != nil || owner != "fanout_migrate" {
		t.Errorf("outbox owner %q (%v), want fanout_migrate", owner, err)
	}
	// Owner-level: it can change the schema (rolled back).
	err = pgx.BeginFunc(ctx, migratePool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `ALTER TABLE outbox ADD COLUMN probe int`); err != nil {
			return err
		}
		return errRollback
	})
	if !errors.Is(err, errRollback) {
		t.Errorf("fanout_migrate alters a table: %v", err)
	}
	denied(t, relayPool, "fanout_relay", `CREATE TABLE probe (id int)`)
}

var errRollback = errors.New("rollback")

// ---------------------------------------------------------------------------
// helpers

func loadConfig(t *testing.T) *config.Config {
	t.Helper()
	cfg, err := config.Load("", nil)
	if err != nil {
		t.Fatal(err)
	}
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

// syncBuffer is a bytes.Buffer safe for a process's output and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
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
