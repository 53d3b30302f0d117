// Package salesledger is the subscriber that keeps a per-product sales
// ledger (units sold, revenue) in Postgres: on order.created it adds the
// order's lines to each product's totals, in the same transaction as its
// checkpoint.
//
// Unlike invoicing, whose unique order_id would quietly absorb a second
// handling, the ledger's effect is not idempotent by itself: an event
// handled twice counts its order twice. Only the runtime's checkpoint makes
// it exactly once, so the ledger is a direct witness of invariant 2 (an
// effect happens once): after any fault, each product's ledger must equal
// the sum of its committed order lines. The fault-injection run checks
// exactly that.
package salesledger

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
)

// Name is the subscriber's durable name.
const Name = "salesledger"

// Handler adds orders to the ledger.
type Handler struct{}

// New returns the sales ledger handler.
func New() Handler { return Handler{} }

// Subscriber declares the sales ledger to fanout.
var Subscriber = subscribers.Declaration{
	Name:       Name,
	EventTypes: []string{shop.OrderCreated},
	Grants: []string{
		"SELECT ON orders, order_lines",
		// It adds each order to its products' totals.
		"SELECT, INSERT, UPDATE ON product_sales",
	},
	// Its ledger (migration 00005_product_sales.sql).
	Tables: []string{"product_sales"},
	New:    func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Tx(New()), nil },
}

// ErrMalformed and ErrUnknownOrder are the reasons an order.created event
// goes to the dead letters.
var (
	ErrMalformed    = shop.ErrMalformedOrderEvent
	ErrUnknownOrder = errors.New("unknown order")
)

const (
	// badOrdersSQL returns the events' orders that do not exist or have no
	// lines (nothing an order.created event should name).
	badOrdersSQL = `
SELECT q.id
FROM unnest($1::bigint[]) AS q(id)
LEFT JOIN orders o ON o.id = q.id
WHERE o.id IS NULL OR NOT EXISTS (SELECT FROM order_lines l WHERE l.order_id = q.id)`

	// addSalesSQL adds each event's order lines to the ledger; an order
	// named by two events counts twice (each event is one sale). Rows are
	// upserted in product order, so concurrent batches lock them in one
	// order.
	addSalesSQL = `
INSERT INTO product_sales AS s (product_id, units, revenue)
SELECT l.product_id, sum(l.quantity), sum(l.quantity * l.unit_price)
FROM unnest($1::bigint[]) AS e(order_id)
JOIN order_lines l ON l.order_id = e.order_id
GROUP BY l.product_id
ORDER BY l.product_id
ON CONFLICT (product_id) DO UPDATE
SET units = s.units + excluded.units, revenue = s.revenue + excluded.revenue, updated_at = now()`
)

// HandleTx adds one order to the ledger.
func (h Handler) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	id, err := orderID(ev)
	if err != nil {
		return subscribers.Permanent(err)
	}
	if err := add(ctx, tx, []int64{id}); err != nil {
		if errors.Is(err, errBadOrders) {
			return subscribers.Permanent(fmt.Errorf("%w: order %d does not exist or has no lines", ErrUnknownOrder, id))
		}
		return err
	}
	return nil
}

// HandleBatchTx adds a batch of orders in one round trip.
func (h Handler) HandleBatchTx(ctx context.Context, tx pgx.Tx, evs []subscribers.Event) error {
	ids := make([]int64, 0, len(evs))
	for _, ev := range evs {
		id, err := orderID(ev)
		if err != nil {
			return err // the runtime retries the batch one event at a time
		}
		ids = append(ids, id)
	}
	return add(ctx, tx, ids)
}

var errBadOrders = errors.New("orders that cannot be added")

func add(ctx context.Context, tx pgx.Tx, ids []int64) error {
	var bad []int64
	b := &pgx.Batch{}
	b.Queue(badOrdersSQL, ids).Query(func(rows pgx.Rows) error {
		var err error
		bad, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	b.Queue(addSalesSQL, ids)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("add %d orders to the sales ledger: %w", len(ids), err)
	}
	if len(bad) > 0 {
		// The transaction rolls back with this error.
		return fmt.Errorf("%w: %v", errBadOrders, bad)
	}
	return nil
}

func orderID(ev subscribers.Event) (int64, error) {
	p, err := shop.ParseOrderEvent(ev.Payload)
	return p.OrderID, err
}

// driftSQL lists the products whose ledger differs from the sum of their
// order lines.
const driftSQL = `
WITH sold AS (SELECT product_id, sum(quantity) AS units, sum(quantity * unit_price) AS revenue FROM order_lines GROUP BY product_id)
SELECT coalesce(s.product_id, l.product_id), coalesce(l.units, 0), coalesce(l.revenue, 0)::text, coalesce(s.units, 0), coalesce(s.revenue, 0)::text
FROM product_sales l FULL JOIN sold s ON s.product_id = l.product_id
WHERE l.units IS DISTINCT FROM s.units OR l.revenue IS DISTINCT FROM s.revenue
ORDER BY 1`

// Drift compares the whole ledger with the order lines (after the
// subscriber caught up, they are equal) and describes each product where
// they differ. Tests and the fault run use it.
func Drift(ctx context.Context, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) ([]string, error) {
	rows, err := db.Query(ctx, driftSQL)
	if err != nil {
		return nil, fmt.Errorf("compare the sales ledger with the order lines: %w", err)
	}
	var out []string
	var id, units, want int64
	var revenue, wantRevenue string
	_, err = pgx.ForEachRow(rows, []any{&id, &units, &revenue, &want, &wantRevenue}, func() error {
		out = append(out, "product "+strconv.FormatInt(id, 10)+": ledger "+strconv.FormatInt(units, 10)+" units "+revenue+
			", order lines "+strconv.FormatInt(want, 10)+" units "+wantRevenue)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("compare the sales ledger with the order lines: %w", err)
	}
	return out, nil
}
