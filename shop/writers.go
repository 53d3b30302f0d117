package shop

import (
	"context"
	"errors"
	"fmt"
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
	return outbox.Write(ctx, tx, productEvent(ctx, eventType, ev))
}

func queueProductEvent(ctx context.Context, b *pgx.Batch, eventType string, ev ProductEvent, id *int64) error {
	return outbox.Queue(b, productEvent(ctx, eventType, ev), id)
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
	return outbox.Write(ctx, tx, outbox.Event{
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
	return outbox.Write(ctx, tx, outbox.Event{
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
	eventID, err = outbox.Write(ctx, tx, outbox.Event{
		AggregateType: AggregateOrder,
		AggregateID:   strconv.FormatInt(orderID, 10),
		Type:          OrderCreated,
		Payload:       OrderEvent{OrderID: orderID, Customer: customer, Lines: len(lines)},
		Headers:       outbox.TraceHeaders(ctx, outbox.HeadersFromContext(ctx)),
	})
	return orderID, eventID, err
}
