package deploy_test

// These tests run the real relay and subscribers under the production
// nats-server configuration (deploy/nats/nats-server.conf) and the database
// roles of deploy/postgres/roles.sql, and show what each role may and may
// not do: every refusal is the server's own (a NATS permissions violation
// naming the subject, SQLSTATE 42501 from PostgreSQL).

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

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
	if err := stream.Ensure(ctx, provJS, cfg.Stream, relay.RepublishDelay(cfg.Relay), logger); err != nil {
		t.Fatalf("provision the stream as provisioner: %v", err)
	}
	if _, err := subscribers.ProvisionDeadLetterStream(ctx, provJS, cfg.Subscribers, cfg.Stream.Replicas, stream.Changes{}, logger); err != nil {
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
	relayPool := rolePool(t, cfg, db.URL, "fanout_relay", connect.AsyncCommit(), connect.NoJIT())
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
		id, _ := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
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
		r, err := subscribers.New(subscribers.Options{Declaration: invoicing.Subscriber, Handler: subscribers.Tx(invoicing.New()), Config: cfg.Subscribers, Stream: cfg.Stream,
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
	dl, err := ns.connect(t, "admin_deadletter").js.Stream(ctx, cfg.Subscribers.DeadLetterStream)
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
		first.Header.Get(wire.EventIDHeader) != strconv.FormatInt(badEvent, 10) ||
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

	// A replay as in production: the operator (fanout_operator, and a NATS
	// user that holds no reset of invoicing's consumer) records a request,
	// and invoicing (fanout_invoicing / invoicing) moves its own consumer;
	// its checkpoint skips the order it invoiced.
	replays := bookkeeping.NewReplays(rolePool(t, cfg, db.URL, "fanout_operator"))
	asked := time.Now()
	requested, err := replays.Request(ctx, bookkeeping.ReplayRequest{Subscriber: invoicing.Name, Stream: cfg.Stream.Name, FromSeq: 1, Within: 30 * time.Second, Reason: "the pipeline test"})
	if err != nil {
		t.Fatalf("fanout_operator requests a replay: %v", err)
	}
	waitFor(t, "invoicing to carry out the replay", func() bool {
		o, err := replays.Outcome(ctx, requested)
		return err == nil && o == bookkeeping.ReplayOutcome{Outcome: bookkeeping.ReplayMoved, Actor: "fanout_invoicing"}
	})
	waitFor(t, "the replayed events acked again", func() bool {
		c, err := cons.Consumer(ctx, cfg.Stream.Name, invoicing.Name)
		if err != nil {
			return false
		}
		ci := c.CachedInfo()
		return ci.NumAckPending == 0 && ci.NumPending == 0 && ci.AckFloor.Stream == 2 && ci.Delivered.Last != nil && ci.Delivered.Last.After(asked)
	})
	var invoices int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = $1`, orderID).Scan(&invoices); err != nil || invoices != 1 {
		t.Errorf("%d invoices of the order after the replay (%v), want 1", invoices, err)
	}

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
func natsConn(t *testing.T, cfg *settings, ns *natsServer, user string, logger *slog.Logger) *nats.Conn {
	t.Helper()
	nc := cfg.NATS
	nc.URL, nc.User, nc.Password, nc.CAFile = ns.url, user, ns.passwords[user], ns.caFile
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
