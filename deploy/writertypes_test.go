package deploy_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestWritersWriteTheirOwnEventTypes attacks the outbox as a catalog
// application that is a writer: with the migration's declaration
// (fanout_writer may write every type, as before the check) it commits
// order.created, which every order subscriber would take for an order.
// Once the operator declares each application's types and withdraws that
// one, Postgres refuses it, also after SET ROLE fanout_writer and in a
// batch, and the refused event takes no aggregate number; the order
// application writes it. Nobody but the operator changes a declaration;
// a member of the outbox's owner writes any type.
func TestWritersWriteTheirOwnEventTypes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := loadConfig(t)
	db := pgtest.NewDB(t)
	applyRoles(t, db.URL)
	suffix := randomHex(t, 4)
	catalog, orders := "app_catalog_"+suffix, "app_orders_"+suffix
	withRolesLock(t, func(c *pgx.Conn) error {
		for _, role := range []string{catalog, orders} {
			id := pgx.Identifier{role}.Sanitize()
			if _, err := c.Exec(ctx, "CREATE ROLE "+id+" LOGIN IN ROLE fanout_writer"); err != nil {
				return err
			}
		}
		return nil
	})
	t.Cleanup(func() {
		withRolesLock(t, func(c *pgx.Conn) error {
			for _, role := range []string{catalog, orders} {
				id := pgx.Identifier{role}.Sanitize()
				if _, err := c.Exec(context.Background(), "REVOKE CONNECT ON DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" FROM "+id+"; DROP ROLE IF EXISTS "+id); err != nil {
					t.Logf("drop role %s: %v", role, err)
				}
			}
			return nil
		})
	})
	for _, role := range []string{catalog, orders} {
		if _, err := db.Pool.Exec(ctx, "GRANT CONNECT ON DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" TO "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	catalogPool, ordersPool := rolePool(t, cfg, db.URL, catalog), rolePool(t, cfg, db.URL, orders)
	operator := outboxstore.NewWriters(rolePool(t, cfg, db.URL, "fanout_operator"))

	write := func(pool *pgxpool.Pool, typ string, setRole bool) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if setRole {
				if _, err := tx.Exec(ctx, "SET LOCAL ROLE fanout_writer"); err != nil {
					return err
				}
			}
			_, err := outbox.Write(ctx, tx, outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: "77", Type: typ,
				Payload: shop.OrderEvent{OrderID: 77, Customer: "eve", Lines: 1}})
			return err
		})
	}
	refused := func(who, typ string, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" || !strings.Contains(pgErr.Message, typ) || !strings.Contains(pgErr.Message, who) {
			t.Errorf("%s writes %s: %v; want SQLSTATE 42501 naming the role and the type", who, typ, err)
			return
		}
		t.Logf("refused: %s writes %s: %s", who, typ, pgErr.Message)
	}

	// Before: any writer writes any type.
	if err := write(catalogPool, shop.OrderCreated, false); err != nil {
		t.Fatalf("with fanout_writer declared for every type, %s writes %s: %v", catalog, shop.OrderCreated, err)
	}

	for _, d := range []struct{ role, typ string }{{catalog, shop.ProductUpdated}, {orders, shop.OrderCreated}} {
		if added, err := operator.Allow(ctx, d.role, d.typ, "its service"); err != nil || !added {
			t.Fatalf("the operator lets %s write %s: %t, %v", d.role, d.typ, added, err)
		}
	}
	if gone, err := operator.Withdraw(ctx, "fanout_writer", outboxstore.AnyEventType); err != nil || !gone {
		t.Fatalf("the operator withdraws fanout_writer's '*': %t, %v", gone, err)
	}
	decls, err := operator.List(ctx)
	if err != nil || len(decls) != 2 || decls[0].DeclaredBy != "fanout_operator" {
		t.Fatalf("declarations %+v (%v), want two recorded as fanout_operator's", decls, err)
	}

	if err := write(catalogPool, shop.ProductUpdated, false); err != nil {
		t.Errorf("%s writes its own %s: %v", catalog, shop.ProductUpdated, err)
	}
	if err := write(ordersPool, shop.OrderCreated, false); err != nil {
		t.Errorf("%s writes its own %s: %v", orders, shop.OrderCreated, err)
	}
	refused(catalog, shop.OrderCreated, write(catalogPool, shop.OrderCreated, false))
	refused(catalog, shop.OrderCreated, write(catalogPool, shop.OrderCreated, true))
	refused(orders, shop.ProductUpdated, write(ordersPool, shop.ProductUpdated, false))
	// In a batch beside an event of its own: the transaction fails whole.
	err = pgx.BeginFunc(ctx, catalogPool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		for _, typ := range []string{shop.ProductUpdated, shop.OrderPaid} {
			if err := outbox.Queue(b, outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: "77", Type: typ, Payload: map[string]int{"order_id": 77}}, nil); err != nil {
				return err
			}
		}
		return tx.SendBatch(ctx, b).Close()
	})
	refused(catalog, shop.OrderPaid, err)

	// Three events of order 77 were written (catalog's before the check,
	// catalog's product.updated, orders' order.created): numbered 1 to 3,
	// none taken by a refused one.
	var rows, last int64
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), (SELECT last_seq FROM outbox_aggregates WHERE aggregate_type = $1 AND aggregate_id = '77')
FROM outbox WHERE aggregate_id = '77'`, shop.AggregateOrder).Scan(&rows, &last); err != nil || rows != 3 || last != 3 {
		t.Errorf("order 77: %d rows, last number %d (%v); want 3 and 3", rows, last, err)
	}

	// Nobody but the operator declares: not the writers, the relay or a
	// subscriber.
	for _, who := range []struct {
		name string
		pool *pgxpool.Pool
	}{{catalog, catalogPool}, {"fanout_relay", rolePool(t, cfg, db.URL, "fanout_relay")}, {"fanout_invoicing", rolePool(t, cfg, db.URL, "fanout_invoicing")}} {
		denied(t, who.pool, who.name, `SELECT fanout_outbox_allow_writer($1, 'order.created', 'mine')`, who.name)
		denied(t, who.pool, who.name, `SELECT fanout_outbox_withdraw_writer($1, 'order.created')`, orders)
		denied(t, who.pool, who.name, `INSERT INTO outbox_writer_types (writer, event_type, reason) VALUES ($1, '*', 'mine')`, who.name)
		denied(t, who.pool, who.name, `DELETE FROM outbox_writer_types`)
	}
	// The outbox's owner may drop the check anyway, and a development setup
	// writes as the owner: a member of it passes.
	withRolesLock(t, func(c *pgx.Conn) error {
		_, err := c.Exec(ctx, "GRANT fanout_migrate TO "+pgx.Identifier{catalog}.Sanitize())
		return err
	})
	if err := write(catalogPool, shop.OrderCreated, false); err != nil {
		t.Errorf("%s, a member of the outbox's owner, writes %s: %v", catalog, shop.OrderCreated, err)
	}
	if _, err := operator.Allow(ctx, "no_such_role_"+suffix, shop.OrderCreated, "x"); err == nil || !strings.Contains(err.Error(), "no role") {
		t.Errorf("a declaration for a role that does not exist: %v, want refused", err)
	}
}
