package deploy_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/types"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/example"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
)

// TestANewSubscriber adds a subscriber the way docs/subscribers.md says: its package
// (subscribers/example) and one line in the registry (here behind the
// fanout_example build tag, so the shipped binary does not carry it). The
// binary built with it then renders its deployment, and the rendered files
// run it: its NATS user and permissions (nats-server started with the
// rendered configuration), its Postgres role (the rendered roles script on
// a fresh database), its consumer (`fanout provision`), its compose
// service, its place in `fanout status`; it handles an order as its own
// identities and dead-letters one of an unknown order. Its place in the fault run
// is TestChaosWithANewSubscriber (faultrun).
func TestANewSubscriber(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "fanout")
	if out, err := exec.Command("go", "build", "-tags", "fanout_example", "-o", bin, filepath.Join(root, "cmd/fanout")).CombinedOutput(); err != nil {
		t.Fatalf("build fanout with the example subscriber: %v\n%s", err, out)
	}
	fanoutCmd := func(env []string, args ...string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = append(os.Environ(), append([]string{"FANOUT_LOG_FORMAT=json", "FANOUT_HTTP_ADDR="}, env...)...)
		return cmd
	}

	// Its deployment, rendered.
	dir := t.TempDir()
	if out, err := fanoutCmd(nil, "deploy", "render", dir).CombinedOutput(); err != nil {
		t.Fatalf("deploy render: %v\n%s", err, out)
	}
	for _, f := range []string{"nats/nats-server.conf", "postgres/roles.sql", "compose.yaml", "secrets/generate.sh"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil || !strings.Contains(string(b), example.Name) {
			t.Fatalf("rendered %s does not name the new subscriber (%v)", f, err)
		}
	}

	// Its compose service, parsed as `docker compose config` does.
	project := loadComposeIn(t, dir)
	svc, ok := project.Services[example.Name]
	if !ok {
		t.Fatalf("compose has no %s service", example.Name)
	}
	if !slices.Equal(svc.Command, []string{"subscribe", example.Name}) {
		t.Errorf("compose %s command %v", example.Name, svc.Command)
	}
	if u := svc.Environment["FANOUT_NATS_USER"]; u == nil || *u != example.Name {
		t.Errorf("compose %s runs as NATS user %v", example.Name, u)
	}
	if u := svc.Environment["FANOUT_POSTGRES_URL"]; u == nil || !strings.Contains(*u, "fanout_"+example.Name+"@") {
		t.Errorf("compose %s runs as Postgres URL %v", example.Name, u)
	}
	for _, secret := range []string{"pg_example_password", "nats_example_password"} {
		if !slices.ContainsFunc(svc.Secrets, func(s types.ServiceSecretConfig) bool { return s.Source == secret }) {
			t.Errorf("compose %s lacks secret %s", example.Name, secret)
		}
		if _, ok := project.Secrets[secret]; !ok {
			t.Errorf("compose declares no secret %s", secret)
		}
	}

	// Its NATS user, from the rendered configuration.
	users := append(slices.Clone(natsUsers), example.Name)
	ns := startNATSWith(t, filepath.Join(dir, "nats", "nats-server.conf"), users)
	natsEnv := func(user string) []string {
		return []string{"FANOUT_NATS_URL=" + ns.url, "FANOUT_NATS_USER=" + user, "FANOUT_NATS_PASSWORD=" + ns.passwords[user], "FANOUT_NATS_CA_FILE=" + ns.caFile,
			"FANOUT_STREAM_PROVISION=verify", "FANOUT_SUBSCRIBERS_DEAD_LETTER_PROVISION=verify"}
	}

	// Its Postgres role, from the rendered script.
	db := pgtest.NewDB(t)
	applyRolesFile(t, filepath.Join(dir, "postgres", "roles.sql"), db.URL)
	pgEnv := func(role string) []string { return []string{"FANOUT_POSTGRES_URL=" + roleURL(t, db.URL, role)} }

	// Its consumer, created by the provisioning job.
	out, err := fanoutCmd(natsEnv("provisioner"), "provision").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "consumer example: filters events.order.created") {
		t.Fatalf("provision: %v\n%s", err, out)
	}

	// An order and an event of an order that does not exist, relayed as the relay.
	var orderID, goodEvent, badEvent int64
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var productID int64
		if err := tx.QueryRow(ctx, `
WITH b AS (INSERT INTO brands (name) VALUES ('Acme') RETURNING id),
     c AS (INSERT INTO categories (name) VALUES ('phones') RETURNING id)
INSERT INTO products (sku, name, brand_id, category_id, price)
SELECT 'SKU-1', 'Phone', b.id, c.id, 199.00 FROM b, c RETURNING id`).Scan(&productID); err != nil {
			return err
		}
		var err error
		if orderID, goodEvent, err = shop.CreateOrder(ctx, tx, "ada", []shop.OrderLine{{ProductID: productID, Quantity: 2}}); err != nil {
			return err
		}
		// Its payload matches order.created's schema (the relay fails
		// one that does not): the subscriber's own verdict sends it to
		// its dead letters.
		badEvent, err = outbox.Write(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: "?", Type: shop.OrderCreated,
			Payload: json.RawMessage(`{"order_id": 987654321}`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	start := func(name string, env []string, args ...string) *syncbuf.Buffer {
		t.Helper()
		logs := &syncbuf.Buffer{}
		cmd := fanoutCmd(env, args...)
		cmd.Stdout, cmd.Stderr = logs, logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
			if t.Failed() {
				t.Logf("%s:\n%s", name, logs.String())
			}
		})
		return logs
	}
	start("relay", append(natsEnv("relay"), pgEnv("fanout_relay")...), "relay")

	// The new subscriber, as its own identities only.
	logs := start("example", append(natsEnv(example.Name), pgEnv("fanout_"+example.Name)...), "subscribe", example.Name)
	waitFor(t, "the example subscriber's checkpoint of the order", func() bool {
		var n int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE subscriber = $1 AND event_id = $2`, example.Name, goodEvent).Scan(&n)
		return err == nil && n == 1
	})
	if !strings.Contains(logs.String(), `"order_id":`+strconv.FormatInt(orderID, 10)) {
		t.Errorf("the example subscriber did not log the order %d:\n%s", orderID, logs.String())
	}
	admin := ns.connect(t, "admin")
	adminDL := ns.connect(t, "admin_deadletter")
	waitFor(t, "the unknown order's dead letter from the example subscriber", func() bool {
		dls, err := adminDL.js.Stream(ctx, "DEADLETTER")
		if err != nil {
			return false
		}
		m, err := dls.GetLastMsgForSubject(ctx, "deadletter.example.order.created")
		return err == nil && m.Header.Get(wire.EventIDHeader) == strconv.FormatInt(badEvent, 10) &&
			strings.Contains(m.Header.Get(subscribers.DeadReasonHeader), example.ErrUnknownOrder.Error())
	})
	waitFor(t, "the example consumer to have both events settled", func() bool {
		c, err := admin.js.Consumer(ctx, "EVENTS", example.Name)
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0
	})
	if strings.Contains(logs.String(), "Permissions Violation") || strings.Contains(logs.String(), "permission denied") {
		t.Errorf("the example subscriber was refused something it needs:\n%s", logs.String())
	}

	// Its place in `fanout status`, read as the operator.
	out, err = fanoutCmd(append(natsEnv("operator"), pgEnv("fanout_operator")...), "status", "--json").CombinedOutput()
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	type subscriberStatus struct {
		Name        string `json:"name"`
		Checkpoints int64  `json:"checkpoint_rows"`
		DeadLetters int64  `json:"dead_letters"`
	}
	var status struct {
		Subscribers []subscriberStatus `json:"subscribers"`
	}
	if err := json.Unmarshal(out, &status); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	i := slices.IndexFunc(status.Subscribers, func(s subscriberStatus) bool { return s.Name == example.Name })
	if i < 0 || status.Subscribers[i].DeadLetters != 1 || status.Subscribers[i].Checkpoints != 1 {
		t.Errorf("status lists the example subscriber as %+v, want it with its dead letter\n%s", status.Subscribers, out)
	}
}
