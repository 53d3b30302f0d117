// Package invoicing is the subscriber that invoices orders: on
// order.created it creates the order's invoice (number, lines, total from
// the order's lines) in the same transaction as its checkpoint, so each
// order gets exactly one invoice however often the event arrives. invoices
// has a unique order_id as a second line of defence.
package invoicing

import (
	"context"
	"errors"
	"fmt"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
)

// Name is the subscriber's durable name.
const Name = "invoicing"

// Handler invoices orders.
type Handler struct{}

// New returns the invoicing handler.
func New() Handler { return Handler{} }

// Subscriber declares invoicing to fanout: one line in the registry runs,
// provisions and deploys it.
var Subscriber = subscribers.Declaration{
	Name:       Name,
	EventTypes: []string{shop.OrderCreated},
	Grants: []string{
		"SELECT ON orders, order_lines, products",
		"INSERT ON invoices, invoice_lines",
		// ON CONFLICT (order_id) and RETURNING id read these columns.
		"SELECT (id, order_id) ON invoices",
		"USAGE ON SEQUENCE invoice_number_seq",
	},
	// `fanout backfill invoicing` invoices the orders whose order.created
	// the stream no longer holds: an order.created per order, naming it;
	// the handler reads its lines, and invoices it once however often.
	Backfill: &subscribers.Backfill{
		Table: "orders", Key: "id", EventType: shop.OrderCreated, AggregateType: shop.AggregateOrder,
		Payload: "jsonb_build_object('order_id', t.id, 'customer', t.customer)",
	},
	New: func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Tx(New()), nil },
}

// ErrMalformed, ErrUnknownOrder and ErrMissingProduct (a line with no
// snapshot whose product is gone) are the reasons an
// order.created event goes to the dead letters.
var (
	ErrMalformed      = shop.ErrMalformedOrderEvent
	ErrUnknownOrder   = errors.New("unknown order")
	ErrMissingProduct = errors.New("order line references a missing product")
)

const (
	// checkOrderSQL says whether the order exists, how many lines it has,
	// and the first line whose product is gone.
	checkOrderSQL = `
SELECT o.id IS NOT NULL,
       count(l.line_no),
       min(l.line_no) FILTER (WHERE l.sku IS NULL AND p.id IS NULL),
       min(l.product_id) FILTER (WHERE l.sku IS NULL AND p.id IS NULL)
FROM (SELECT $1::bigint AS id) q
LEFT JOIN orders o ON o.id = q.id
LEFT JOIN order_lines l ON l.order_id = o.id
LEFT JOIN products p ON p.id = l.product_id
GROUP BY o.id`

	// createInvoiceSQL creates the invoice and its lines in one statement.
	// ON CONFLICT makes a second invoice for the order impossible even if
	// the checkpoint were bypassed.
	createInvoiceSQL = `
WITH invoice AS (
    INSERT INTO invoices (order_id, number, total)
    SELECT $1, 'INV-' || to_char(now(), 'YYYY') || '-' || lpad(nextval('invoice_number_seq')::text, 8, '0'),
           sum(quantity * unit_price)
    FROM order_lines WHERE order_id = $1
    HAVING count(*) > 0
    ON CONFLICT (order_id) DO NOTHING
    RETURNING id
)
INSERT INTO invoice_lines (invoice_id, line_no, sku, description, quantity, unit_price, amount)
SELECT invoice.id, l.line_no, coalesce(l.sku, p.sku), coalesce(l.name, p.name), l.quantity, l.unit_price, l.quantity * l.unit_price
FROM invoice
JOIN order_lines l ON l.order_id = $1
LEFT JOIN products p ON p.id = l.product_id
WHERE coalesce(l.sku, p.sku) IS NOT NULL -- a line the check rejects: the transaction rolls back`
)

// HandleTx creates the order's invoice inside tx. The check and the insert
// travel in one round trip; if the check fails, the returned error rolls the
// insert back with the rest of the transaction.
func (Handler) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	p, err := shop.ParseOrderEvent(ev.Payload)
	if err != nil {
		return subscribers.Permanent(err)
	}
	var (
		exists                      bool
		lines                       int
		missingLine, missingProduct *int64
	)
	b := &pgx.Batch{}
	b.Queue(checkOrderSQL, p.OrderID).QueryRow(func(row pgx.Row) error {
		return row.Scan(&exists, &lines, &missingLine, &missingProduct)
	})
	b.Queue(createInvoiceSQL, p.OrderID)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("invoice order %d: %w", p.OrderID, err)
	}
	switch {
	case !exists:
		return subscribers.Permanent(fmt.Errorf("%w: order %d does not exist", ErrUnknownOrder, p.OrderID))
	case lines == 0:
		return subscribers.Permanent(fmt.Errorf("%w: order %d has no lines", ErrMalformed, p.OrderID))
	case missingLine != nil:
		return subscribers.Permanent(fmt.Errorf("%w: order %d line %d names product %d, which does not exist",
			ErrMissingProduct, p.OrderID, *missingLine, *missingProduct))
	}
	return nil
}

const (
	// checkOrdersSQL returns the orders of a batch that cannot be invoiced.
	checkOrdersSQL = `
SELECT q.id
FROM unnest($1::bigint[]) AS q(id)
LEFT JOIN orders o ON o.id = q.id
LEFT JOIN order_lines l ON l.order_id = o.id
LEFT JOIN products p ON p.id = l.product_id
GROUP BY q.id, o.id
HAVING o.id IS NULL OR count(l.line_no) = 0 OR count(*) FILTER (WHERE l.line_no IS NOT NULL AND l.sku IS NULL AND p.id IS NULL) > 0`

	// createInvoicesSQL is createInvoiceSQL for a set of orders.
	createInvoicesSQL = `
WITH invoice AS (
    INSERT INTO invoices (order_id, number, total)
    SELECT order_id, 'INV-' || to_char(now(), 'YYYY') || '-' || lpad(nextval('invoice_number_seq')::text, 8, '0'),
           sum(quantity * unit_price)
    FROM order_lines WHERE order_id = ANY($1)
    GROUP BY order_id
    ORDER BY order_id
    ON CONFLICT (order_id) DO NOTHING
    RETURNING id, order_id
)
INSERT INTO invoice_lines (invoice_id, line_no, sku, description, quantity, unit_price, amount)
SELECT invoice.id, l.line_no, coalesce(l.sku, p.sku), coalesce(l.name, p.name), l.quantity, l.unit_price, l.quantity * l.unit_price
FROM invoice
JOIN order_lines l ON l.order_id = invoice.order_id
LEFT JOIN products p ON p.id = l.product_id
WHERE coalesce(l.sku, p.sku) IS NOT NULL`
)

// errBatchHasBadOrders makes the runtime handle the batch's events one by
// one, where HandleTx gives each bad one its precise reason.
var errBatchHasBadOrders = errors.New("batch holds orders that cannot be invoiced")

// HandleBatchTx invoices a batch of orders with two set-based statements in
// one round trip, instead of a round trip per order.
func (Handler) HandleBatchTx(ctx context.Context, tx pgx.Tx, evs []subscribers.Event) error {
	ids := make([]int64, 0, len(evs))
	for _, ev := range evs {
		p, err := shop.ParseOrderEvent(ev.Payload)
		if err != nil {
			return errBatchHasBadOrders
		}
		ids = append(ids, p.OrderID)
	}
	var bad []int64
	b := &pgx.Batch{}
	b.Queue(checkOrdersSQL, ids).Query(func(rows pgx.Rows) error {
		var err error
		bad, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	b.Queue(createInvoicesSQL, ids)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("invoice %d orders: %w", len(ids), err)
	}
	if len(bad) > 0 {
		return fmt.Errorf("%w: %v", errBatchHasBadOrders, bad)
	}
	return nil
}
