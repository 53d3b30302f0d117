package shop

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNotFound is returned when a writer's target does not exist.
var ErrNotFound = errors.New("not found")

// NewProduct describes a product to create.
type NewProduct struct {
	SKU         string
	Name        string
	Description string
	BrandID     int64
	CategoryID  int64
	PriceCents  int64
	Rating      float64
	RAMGB       int
	StorageGB   int
	Stock       int
}

func productEvent(ctx context.Context, eventType string, ev ProductEvent) outbox.Event {
	return outbox.Event{
		AggregateType: AggregateProduct,
		AggregateID:   strconv.FormatInt(ev.ProductID, 10),
		Type:          eventType,
		Payload:       ev,
		Headers:       outbox.TraceHeaders(ctx, outbox.HeadersFromContext(ctx)),
	}
}

func writeProductEvent(ctx context.Context, tx pgx.Tx, eventType string, ev ProductEvent) (int64, error) {
	return writer.Write(ctx, tx, productEvent(ctx, eventType, ev))
}

func queueProductEvent(ctx context.Context, b *pgx.Batch, eventType string, ev ProductEvent, id *int64) error {
	return writer.Queue(b, productEvent(ctx, eventType, ev), id)
}

// CreateProduct inserts a product with its stock and records product.created.
func CreateProduct(ctx context.Context, tx pgx.Tx, p NewProduct) (productID int64, err error) {
	err = tx.QueryRow(ctx, `
INSERT INTO products (sku, name, description, brand_id, category_id, price, rating, ram_gb, storage_gb)
VALUES ($1, $2, $3, $4, $5, $6::numeric / 100, $7, $8, $9)
RETURNING id`, p.SKU, p.Name, p.Description, p.BrandID, p.CategoryID, p.PriceCents, p.Rating, p.RAMGB, p.StorageGB).Scan(&productID)
	if err != nil {
		return 0, fmt.Errorf("create product %s: %w", p.SKU, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO inventory (product_id, stock) VALUES ($1, $2)`, productID, p.Stock); err != nil {
		return 0, fmt.Errorf("create stock of product %d: %w", productID, err)
	}
	price, stock := p.PriceCents, p.Stock
	if _, err := writeProductEvent(ctx, tx, ProductCreated, ProductEvent{ProductID: productID, Version: 1, PriceCents: &price, Stock: &stock}); err != nil {
		return 0, err
	}
	return productID, nil
}

// UpdatePrice sets a product's price and records product.updated. The update
// and the event go to the server in one round trip (outbox.Queue).
func UpdatePrice(ctx context.Context, tx pgx.Tx, productID, priceCents int64) (eventID int64, err error) {
	b := &pgx.Batch{}
	var updated int64
	b.Queue(`UPDATE products SET price = $2::numeric / 100, version = version + 1, updated_at = now() WHERE id = $1`,
		productID, priceCents).Exec(func(ct pgconn.CommandTag) error {
		updated = ct.RowsAffected()
		return nil
	})
	if err := queueProductEvent(ctx, b, ProductUpdated, ProductEvent{ProductID: productID, PriceCents: &priceCents}, &eventID); err != nil {
		return 0, err
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return 0, fmt.Errorf("update price of product %d: %w", productID, err)
	}
	if updated == 0 {
		return 0, fmt.Errorf("update price of product %d: %w", productID, ErrNotFound)
	}
	return eventID, nil
}

// ChangeStock adds delta (possibly negative) to a product's stock, never
// below zero, and records product.stock_changed, in one round trip.
func ChangeStock(ctx context.Context, tx pgx.Tx, productID int64, delta int) (eventID int64, err error) {
	b := &pgx.Batch{}
	var updated int64
	b.Queue(`UPDATE inventory SET stock = greatest(stock + $2, 0), updated_at = now() WHERE product_id = $1`,
		productID, delta).Exec(func(ct pgconn.CommandTag) error {
		updated = ct.RowsAffected()
		return nil
	})
	b.Queue(`UPDATE products SET version = version + 1, updated_at = now() WHERE id = $1`, productID)
	if err := queueProductEvent(ctx, b, ProductStockChanged, ProductEvent{ProductID: productID, StockDelta: &delta}, &eventID); err != nil {
		return 0, err
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return 0, fmt.Errorf("change stock of product %d: %w", productID, err)
	}
	if updated == 0 {
		return 0, fmt.Errorf("change stock of product %d: %w", productID, ErrNotFound)
	}
	return eventID, nil
}

// DeleteProduct deletes a product (its stock goes with it) and records
// product.deleted.
func DeleteProduct(ctx context.Context, tx pgx.Tx, productID int64) (eventID int64, err error) {
	var version int64
	err = tx.QueryRow(ctx, `DELETE FROM products WHERE id = $1 RETURNING version`, productID).Scan(&version)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("delete product %d: %w", productID, ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("delete product %d: %w", productID, err)
	}
	return writeProductEvent(ctx, tx, ProductDeleted, ProductEvent{ProductID: productID, Version: version})
}

// RenameBrand renames a brand, bumps the version of each of its products
// (their search documents carry the brand name) and records brand.updated.
func RenameBrand(ctx context.Context, tx pgx.Tx, brandID int64, name string) (eventID int64, err error) {
	ct, err := tx.Exec(ctx, `UPDATE brands SET name = $2, updated_at = now() WHERE id = $1`, brandID, name)
	if err != nil {
		return 0, fmt.Errorf("rename brand %d: %w", brandID, err)
	}
	if ct.RowsAffected() == 0 {
		return 0, fmt.Errorf("rename brand %d: %w", brandID, ErrNotFound)
	}
	ct, err = tx.Exec(ctx, `UPDATE products SET version = version + 1, updated_at = now() WHERE brand_id = $1`, brandID)
	if err != nil {
		return 0, fmt.Errorf("bump versions of brand %d's products: %w", brandID, err)
	}
	return writer.Write(ctx, tx, outbox.Event{
		AggregateType: AggregateBrand,
		AggregateID:   strconv.FormatInt(brandID, 10),
		Type:          BrandUpdated,
		Payload:       BrandEvent{BrandID: brandID, Name: name, Products: int(ct.RowsAffected())},
		Headers:       outbox.TraceHeaders(ctx, outbox.HeadersFromContext(ctx)),
	})
}

// RenameCategory renames a category, bumps the version of each of its
// products (their search documents and cached copies carry the category
// name) and records category.updated.
func RenameCategory(ctx context.Context, tx pgx.Tx, categoryID int64, name string) (eventID int64, err error) {
	ct, err := tx.Exec(ctx, `UPDATE categories SET name = $2 WHERE id = $1`, categoryID, name)
	if err != nil {
		return 0, fmt.Errorf("rename category %d: %w", categoryID, err)
	}
	if ct.RowsAffected() == 0 {
		return 0, fmt.Errorf("rename category %d: %w", categoryID, ErrNotFound)
	}
	// Without the bump, the indexer would write the new name under the
	// version the index already has: a 409, counted as done, and the old
	// name would stay in the index for good.
	ct, err = tx.Exec(ctx, `UPDATE products SET version = version + 1, updated_at = now() WHERE category_id = $1`, categoryID)
	if err != nil {
		return 0, fmt.Errorf("bump versions of category %d's products: %w", categoryID, err)
	}
	return writer.Write(ctx, tx, outbox.Event{
		AggregateType: AggregateCategory,
		AggregateID:   strconv.FormatInt(categoryID, 10),
		Type:          CategoryUpdated,
		Payload:       CategoryEvent{CategoryID: categoryID, Name: name, Products: int(ct.RowsAffected())},
		Headers:       outbox.TraceHeaders(ctx, outbox.HeadersFromContext(ctx)),
	})
}

// OrderLine is one line of a new order.
type OrderLine struct {
	ProductID int64
	Quantity  int
}

// CreateOrder creates an order whose lines take each product's current
// price, and records order.created. A product that does not exist is
// ErrNotFound.
func CreateOrder(ctx context.Context, tx pgx.Tx, customer string, lines []OrderLine) (orderID, eventID int64, err error) {
	if len(lines) == 0 {
		return 0, 0, fmt.Errorf("create order: no lines")
	}
	if err := tx.QueryRow(ctx, `INSERT INTO orders (customer) VALUES ($1) RETURNING id`, customer).Scan(&orderID); err != nil {
		return 0, 0, fmt.Errorf("create order: %w", err)
	}
	for i, l := range lines {
		ct, err := tx.Exec(ctx, `
INSERT INTO order_lines (order_id, line_no, product_id, sku, name, quantity, unit_price)
SELECT $1, $2, id, sku, name, $4, price FROM products WHERE id = $3`, orderID, i+1, l.ProductID, l.Quantity)
		if err != nil {
			return 0, 0, fmt.Errorf("create order line %d: %w", i+1, err)
		}
		if ct.RowsAffected() == 0 {
			return 0, 0, fmt.Errorf("create order line %d: product %d: %w", i+1, l.ProductID, ErrNotFound)
		}
	}
	if _, err := tx.Exec(ctx, `INSERT INTO order_transitions (order_id, n, to_status) VALUES ($1, 1, $2)`, orderID, StatusCreated); err != nil {
		return 0, 0, fmt.Errorf("create order: its first transition: %w", err)
	}
	eventID, err = writer.Write(ctx, tx, outbox.Event{
		AggregateType: AggregateOrder,
		AggregateID:   strconv.FormatInt(orderID, 10),
		Type:          OrderCreated,
		Payload:       OrderEvent{OrderID: orderID, Customer: customer, Lines: len(lines)},
		Headers:       outbox.TraceHeaders(ctx, outbox.HeadersFromContext(ctx)),
	})
	return orderID, eventID, err
}

// ErrTransition is returned when an order's status does not allow the
// transition asked for (nothing follows delivered or cancelled).
var ErrTransition = errors.New("transition not allowed")

// PayOrder moves a created order to paid, and records order.paid.
func PayOrder(ctx context.Context, tx pgx.Tx, orderID int64) (eventID int64, err error) {
	return moveOrder(ctx, tx, orderID, StatusPaid)
}

// ShipOrder moves a paid order to shipped, and records order.shipped.
func ShipOrder(ctx context.Context, tx pgx.Tx, orderID int64) (eventID int64, err error) {
	return moveOrder(ctx, tx, orderID, StatusShipped)
}

// DeliverOrder moves a shipped order to delivered, and records
// order.delivered.
func DeliverOrder(ctx context.Context, tx pgx.Tx, orderID int64) (eventID int64, err error) {
	return moveOrder(ctx, tx, orderID, StatusDelivered)
}

// CancelOrder cancels an order not yet delivered, and records
// order.cancelled.
func CancelOrder(ctx context.Context, tx pgx.Tx, orderID int64) (eventID int64, err error) {
	return moveOrder(ctx, tx, orderID, StatusCancelled)
}

// moveOrder applies one transition under the order's row lock, so that
// two writers of one order take turns: the transitions' numbers, and the
// events' order in the outbox (aggregate_seq), follow their commits. A
// status that does not allow it is ErrTransition; a missing order,
// ErrNotFound.
func moveOrder(ctx context.Context, tx pgx.Tx, orderID int64, to string) (int64, error) {
	var from string
	err := tx.QueryRow(ctx, `SELECT status FROM orders WHERE id = $1 FOR UPDATE`, orderID).Scan(&from)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("order %d: %w", orderID, ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("order %d: read its status: %w", orderID, err)
	}
	if !slices.Contains(TransitionFrom[to], from) {
		return 0, fmt.Errorf("order %d is %s and cannot become %s: %w", orderID, from, to, ErrTransition)
	}
	var n int
	err = tx.QueryRow(ctx, `
WITH moved AS (UPDATE orders SET status = $3 WHERE id = $1)
INSERT INTO order_transitions (order_id, n, from_status, to_status)
SELECT $1, coalesce(max(n), 0) + 1, $2, $3 FROM order_transitions WHERE order_id = $1
RETURNING n`, orderID, from, to).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("order %d: become %s: %w", orderID, to, err)
	}
	return writer.Write(ctx, tx, outbox.Event{
		AggregateType: AggregateOrder,
		AggregateID:   strconv.FormatInt(orderID, 10),
		Type:          "order." + to,
		Payload:       OrderTransition{OrderID: orderID, From: from, To: to, N: n},
		Headers:       outbox.TraceHeaders(ctx, outbox.HeadersFromContext(ctx)),
	})
}
