package deploy_test

// These tests run the real relay and subscribers under the production
// nats-server configuration (deploy/nats/nats-server.conf) and the database
// roles of deploy/postgres/roles.sql, and show what each role may and may
// not do: every refusal is the server's own (a NATS permissions violation
// naming the subject, SQLSTATE 42501 from PostgreSQL).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

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
		"outbox_default fanout_relay=dr",
		"outbox_default.status fanout_relay=w",
		"outbox_partitions fanout_relay=r",
		"invoices fanout_invoicing=a",
		"invoices.order_id fanout_invoicing=r",
		"products fanout_cacheinval=r",
		"processed_events fanout_invoicing=dar",
		"policy fanout_invoicing_checkpoints (subscriber = 'invoicing'::text) (subscriber = 'invoicing'::text)",
		// Only ordered subscribers keep a per-aggregate checkpoint.
		"subscriber_aggregates fanout_fulfilment=arw",
		"policy fanout_fulfilment_aggregates (subscriber = 'fulfilment'::text) (subscriber = 'fulfilment'::text)",
		"subscriber_aggregates fanout_operator=r",
		"policy fanout_operator_aggregates true -",
	} {
		if !strings.Contains(first, want+"\n") {
			t.Errorf("privileges lack %q:\n%s", want, first)
		}
	}
	if strings.Contains(first, "subscriber_aggregates fanout_invoicing") {
		t.Errorf("an unordered subscriber may write subscriber_aggregates:\n%s", first)
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
			// The transaction a row belongs to is Postgres's word: a
			// writer cannot join another's (relay.atomic transaction).
			`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, writer_xid) VALUES ('x', '1', 'x.y', '{}', '5')`,
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
		// It vouches for its own dead letters only.
		if _, err := pool.Exec(ctx, `INSERT INTO dead_letters (subscriber, stream_seq, event_id, digest) VALUES ('invoicing', 7, 100, '\x00')`); err != nil {
			t.Errorf("fanout_invoicing vouches for its dead letter: %v", err)
		}
		denied(t, pool, "fanout_invoicing", `INSERT INTO dead_letters (subscriber, stream_seq, event_id, digest) VALUES ('salesledger', 7, 100, '\x00')`)
		denied(t, pool, "fanout_invoicing", `INSERT INTO dead_letter_actions (action, subscriber, stream_seq, outcome, actor) VALUES ('discard', 'invoicing', 7, 'discarded', 'x')`)
		denied(t, pool, "fanout_invoicing", `SELECT fanout_dead_letter_action('discard', 'invoicing', 100, 7, 7, 'discarded', 'x', 100)`)
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
		var checkpoints int64
		store := outboxstore.New(pool)
		if _, err := store.Backlog(ctx); err != nil {
			t.Errorf("fanout_operator reads the outbox backlog: %v", err)
		}
		if _, err := store.CountSent(ctx); err != nil {
			t.Errorf("fanout_operator counts the sent rows: %v", err)
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_events`).Scan(&checkpoints); err != nil || checkpoints < 2 {
			t.Errorf("fanout_operator reads the checkpoints: %d rows (%v), want every subscriber's", checkpoints, err)
		}
		if _, _, err := store.Republish(ctx, time.Now().Add(time.Hour)); err != nil {
			t.Errorf("fanout_operator republishes sent rows: %v", err)
		}
		if _, err := store.RetryFailed(ctx); err != nil {
			t.Errorf("fanout_operator returns failed rows to pending: %v", err)
		}
		// The audit trail: through the function only, which records who.
		if _, err := pool.Exec(ctx, `SELECT fanout_dead_letter_action('discard', 'invoicing', 0, 1, 1, 'discarded', 'an injected letter', 0)`); err != nil {
			t.Errorf("fanout_operator records an action: %v", err)
		}
		var actor string
		if err := pool.QueryRow(ctx, `SELECT actor FROM dead_letter_actions WHERE stream_seq = 1 AND comment = 'an injected letter'`).Scan(&actor); err != nil || actor != "fanout_operator" {
			t.Errorf("the action's actor: %q (%v), want the session's role fanout_operator", actor, err)
		}
		denied(t, pool, "fanout_operator", `INSERT INTO dead_letter_actions (action, subscriber, stream_seq, outcome, actor) VALUES ('discard', 'invoicing', 2, 'discarded', 'someone else')`)
		denied(t, pool, "fanout_operator", `INSERT INTO replays (subscriber, stream, from_seq, outcome, actor) VALUES ('invoicing', 'EVENTS', 1, 'moved', 'someone else')`)
		// Another database sharing the stream, registered: recorded with
		// the session's role, and its origins then numbered.
		if added, err := store.AllowOrigin(ctx, outbox.Database{System: 1, Name: "theirs"}, "their relays share the stream"); err != nil || !added {
			t.Errorf("fanout_operator registers another database: %t, %v", added, err)
		}
		var by string
		if err := db.Pool.QueryRow(ctx, `SELECT registered_by FROM origin_databases WHERE database = 'theirs'`).Scan(&by); err != nil || by != "fanout_operator" {
			t.Errorf("the registration's role: %q (%v), want fanout_operator", by, err)
		}
		denied(t, pool, "fanout_operator", `DELETE FROM origin_databases`)
		if _, err := pool.Exec(ctx, `SELECT fanout_dead_letter_action('discard', 'invoicing', 0, 3, 3, 'discarded', '', 0)`); err == nil || !strings.Contains(err.Error(), "needs a reason") {
			t.Errorf("fanout_operator discards a letter no subscriber vouches for, without a reason: %v; want refused", err)
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
			// The origin numbers are every subscriber's: made-up origins
			// take none (this attack took 32,766 of 32,767 as
			// fanout_cacheinval before migration 00024, and salesledger then
			// dead-lettered every event of a new epoch), nor does a
			// registration of its own.
			var numbered int
			if err := pool.QueryRow(ctx, `SELECT count(fanout_origin_number(i || '/x/1')) FROM generate_series(1, 50) i`).Scan(&numbered); err == nil || !strings.Contains(err.Error(), "is not registered") {
				t.Errorf("%s numbered %d made-up origins (%v), want refused", role, numbered, err)
			}
			denied(t, pool, role, `SELECT fanout_origin_allow('1', 'x', 'mine')`)
			denied(t, pool, role, `INSERT INTO origin_databases (system_identifier, database, reason) VALUES ('1', 'x', 'mine')`)
			denied(t, pool, role, `INSERT INTO event_origins (origin) VALUES ('1/x/1')`)
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

	// A backfill runs as its subscriber's role: the declaration's grants
	// and its table's SELECT cover what it reads; its progress and
	// failures are its own rows; a role without a backfill has neither.
	t.Run("backfill as fanout_invoicing", func(t *testing.T) {
		pool := rolePool(t, cfg, db.URL, "fanout_invoicing")
		scfg := subscribers.DefaultConfig()
		s, err := backfill.Run(ctx, backfill.Options{Declaration: invoicing.Subscriber,
			Handler: subscribers.Tx(invoicing.New()), Config: scfg, Pool: pool, Logger: slog.New(slog.DiscardHandler), Restart: true})
		if err != nil || !s.Finished() || s.Done == 0 || s.Failed != 0 {
			t.Fatalf("invoicing's backfill as its role: %+v, %v", s, err)
		}
		var uninvoiced int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders o WHERE NOT EXISTS (SELECT FROM invoices i WHERE i.order_id = o.id)`).Scan(&uninvoiced); err != nil || uninvoiced != 0 {
			t.Fatalf("%d orders without an invoice after the backfill (%v)", uninvoiced, err)
		}
		denied(t, pool, "fanout_invoicing", `INSERT INTO subscriber_backfills (subscriber, high_key, total_rows) VALUES ('salesledger', 0, 0)`)
		denied(t, pool, "fanout_invoicing", `INSERT INTO subscriber_backfill_segments (subscriber, segment, from_key, to_key, last_key) VALUES ('salesledger', 9, 0, 0, 0)`)
		denied(t, pool, "fanout_invoicing", `INSERT INTO subscriber_backfill_failures (subscriber, row_key, reason) VALUES ('salesledger', 1, 'x')`)
		ledger := rolePool(t, cfg, db.URL, "fanout_salesledger")
		denied(t, ledger, "fanout_salesledger", `SELECT * FROM subscriber_backfills`)
		denied(t, ledger, "fanout_salesledger", `UPDATE subscriber_backfills SET paused = true`)
		// The operator (a member of the subscribers' roles, to act as them)
		// reads every backfill for fanout status.
		op := rolePool(t, cfg, db.URL, "fanout_operator")
		var n int
		if err := op.QueryRow(ctx, `SELECT count(*) FROM subscriber_backfills WHERE subscriber = 'invoicing'`).Scan(&n); err != nil || n != 1 {
			t.Errorf("fanout_operator reads the backfills (fanout status): %d rows, %v", n, err)
		}
	})

	t.Run("fanout_relay", func(t *testing.T) {
		pool := rolePool(t, cfg, db.URL, "fanout_relay")
		denied(t, pool, "fanout_relay", `SELECT * FROM products`)
		denied(t, pool, "fanout_relay", `UPDATE products SET price = 0`)
		denied(t, pool, "fanout_relay", `UPDATE outbox SET event_type = 'x.y'`)
		denied(t, pool, "fanout_relay", `UPDATE outbox SET writer_xid = '5'`)
		denied(t, pool, "fanout_relay", `DELETE FROM processed_events`)
		// The outbox's ranges: only through the functions, which run as
		// their owner.
		var added []string
		rows, err := pool.Query(ctx, `SELECT fanout_outbox_extend(1000, 2, 100)`)
		if err == nil {
			added, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		if err != nil || len(added) == 0 {
			t.Errorf("fanout_relay adds outbox ranges: %v (%v)", added, err)
		}
		for _, name := range added {
			var owner string
			if err := db.Pool.QueryRow(ctx, `SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = $1::regclass`, name).Scan(&owner); err != nil || owner != "fanout_migrate" {
				t.Errorf("range %s is owned by %q (%v), want fanout_migrate", name, owner, err)
			}
		}
		// Fresh statistics after a burst: through the function too, since
		// ANALYZE wants the table's owner.
		var analyzed int
		if err := pool.QueryRow(ctx, `SELECT fanout_outbox_analyze(0)`).Scan(&analyzed); err != nil || analyzed == 0 {
			t.Errorf("fanout_relay analyzes the outbox's ranges: %d ranges (%v)", analyzed, err)
		}
		denied(t, pool, "fanout_relay", `ALTER TABLE outbox DETACH PARTITION outbox_default`)
		denied(t, pool, "fanout_relay", `CREATE TABLE outbox_x PARTITION OF outbox FOR VALUES FROM (-10) TO (0)`)
		denied(t, pool, "fanout_relay", `UPDATE outbox_partitions SET sealed_at = now()`)
		asRole(t, db.Pool, "fanout_writer", func(tx pgx.Tx) {
			denied(t, tx, "fanout_writer", `SELECT fanout_outbox_extend(1000, 2, 100)`)
		})
		asRole(t, db.Pool, "fanout_writer", func(tx pgx.Tx) {
			denied(t, tx, "fanout_writer", `SELECT fanout_outbox_analyze(0)`)
		})
		// Turning numbering off would take ordered subscribers' order away:
		// only the outbox's owner may (fanout outbox numbering).
		denied(t, pool, "fanout_relay", `SELECT fanout_outbox_numbering('{order.paid}')`)
		// An epoch begun below a published event would give it a second
		// identity, and the audit would publish it again under it: as
		// fanout_relay, fanout_outbox_new_epoch(1, 2, 1, NULL, 'x') did,
		// and the sales ledger counted 5 orders twice (migration 00025).
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			id, err := outbox.Write(ctx, tx, orderEvent(orderID))
			if err == nil {
				_, err = tx.Exec(ctx, `UPDATE outbox SET status = 'sent', published_at = now() WHERE id = $1`, id)
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `SELECT fanout_outbox_new_epoch(1, 2, 1, NULL, 'x')`); err == nil || !strings.Contains(err.Error(), "published already") {
			t.Errorf("fanout_relay began an epoch below a published event: %v, want refused", err)
		}
		for _, role := range []string{"fanout_writer", "fanout_operator", "fanout_fulfilment"} {
			asRole(t, db.Pool, role, func(tx pgx.Tx) {
				denied(t, tx, role, `SELECT fanout_outbox_numbering('{order.paid}')`)
			})
		}
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
    FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'S')
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
    SELECT 'policy ' || polname || ' ' || pg_get_expr(polqual, polrelid) || ' ' || coalesce(pg_get_expr(polwithcheck, polrelid), '-')
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
