package shop

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// Product is a product's denormalized document: the product row joined with
// its brand, category and stock. The cache stores it and the search index
// indexes it; Version orders its states.
type Product struct {
	ID          int64   `json:"id"`
	SKU         string  `json:"sku"`
	Name        string  `json:"name"`
	Description string  `json:"description"`
	BrandID     int64   `json:"brand_id"`
	Brand       string  `json:"brand"`
	CategoryID  int64   `json:"category_id"`
	Category    string  `json:"category"`
	PriceCents  int64   `json:"price_cents"`
	Rating      float64 `json:"rating"`
	RAMGB       int     `json:"ram_gb"`
	StorageGB   int     `json:"storage_gb"`
	Stock       int     `json:"stock"`
	Version     int64   `json:"version"`
}

// ProductColumns is the select list of the product document join; use it
// with ProductFrom and ScanProduct.
const ProductColumns = `p.id, p.sku, p.name, p.description, b.id, b.name, c.id, c.name,
       (p.price * 100)::bigint, p.rating::float8, p.ram_gb, p.storage_gb, coalesce(i.stock, 0), p.version`

// ProductFrom is the join behind ProductColumns.
const ProductFrom = `products p
JOIN brands b ON b.id = p.brand_id
JOIN categories c ON c.id = p.category_id
LEFT JOIN inventory i ON i.product_id = p.id`

// ScanProduct scans one row of ProductColumns.
func ScanProduct(row pgx.Row) (Product, error) {
	var p Product
	err := row.Scan(&p.ID, &p.SKU, &p.Name, &p.Description, &p.BrandID, &p.Brand, &p.CategoryID, &p.Category,
		&p.PriceCents, &p.Rating, &p.RAMGB, &p.StorageGB, &p.Stock, &p.Version)
	return p, err
}

// Querier is what the loaders need: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ProductPages calls fn with every product in id order, pageSize at a time,
// through a cursor of tx: one pass over the tables, with each FETCH its own
// short statement, read whole before fn runs, so no statement outlives
// postgres.statement_timeout however large the catalog or slow the
// consumer. (Keyset pages of the join cost a scan of inventory each.) Use a
// REPEATABLE READ transaction for one snapshot across the pages.
func ProductPages(ctx context.Context, tx pgx.Tx, pageSize int, fn func([]Product) error) error {
	if _, err := tx.Exec(ctx, `DECLARE fanout_products NO SCROLL CURSOR FOR SELECT `+ProductColumns+` FROM `+ProductFrom+` ORDER BY p.id`); err != nil {
		return fmt.Errorf("read products: %w", err)
	}
	fetch := `FETCH FORWARD ` + strconv.Itoa(pageSize) + ` FROM fanout_products`
	for {
		rows, err := tx.Query(ctx, fetch)
		if err != nil {
			return fmt.Errorf("read products: %w", err)
		}
		page, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Product, error) { return ScanProduct(row) })
		if err != nil {
			return fmt.Errorf("read products: %w", err)
		}
		if len(page) > 0 {
			if err := fn(page); err != nil {
				return err
			}
		}
		if len(page) < pageSize {
			_, err := tx.Exec(ctx, `CLOSE fanout_products`)
			return err
		}
	}
}

// LoadProducts returns the documents of the products that exist among ids,
// read in one snapshot. Missing ids are simply absent.
func LoadProducts(ctx context.Context, q Querier, ids []int64) (map[int64]Product, error) {
	rows, err := q.Query(ctx, `SELECT `+ProductColumns+` FROM `+ProductFrom+` WHERE p.id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("load products: %w", err)
	}
	products, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Product, error) { return ScanProduct(r) })
	if err != nil {
		return nil, fmt.Errorf("load products: %w", err)
	}
	out := make(map[int64]Product, len(products))
	for _, p := range products {
		out[p.ID] = p
	}
	return out, nil
}
