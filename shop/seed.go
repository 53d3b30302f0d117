package shop

import (
	"context"
	"fmt"
	"math/rand/v2"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	brandNames    = []string{"Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Stark", "Wayne", "Tyrell", "Cyberdyne", "Soylent", "Aperture", "Oscorp", "Wonka", "Pied Piper", "Dunder", "Gringotts", "Nakatomi", "Massive", "Monarch"}
	categoryNames = []string{"phones", "laptops", "tablets", "monitors", "headphones", "cameras", "watches", "consoles", "routers", "storage"}
	adjectives    = []string{"Pro", "Max", "Lite", "Ultra", "Mini", "Air", "Plus", "Neo", "Prime", "Edge"}
)

// Seed makes sure the catalog has its brands and categories and at least n
// products, creating the missing products (with product.created events) in
// transactions of 100. It returns how many products it created.
func Seed(ctx context.Context, pool *pgxpool.Pool, n int, rng *rand.Rand) (int, error) {
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, b := range brandNames {
			if _, err := tx.Exec(ctx, `INSERT INTO brands (name) VALUES ($1) ON CONFLICT DO NOTHING`, b); err != nil {
				return err
			}
		}
		for _, c := range categoryNames {
			if _, err := tx.Exec(ctx, `INSERT INTO categories (name) VALUES ($1) ON CONFLICT DO NOTHING`, c); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		return 0, fmt.Errorf("seed brands and categories: %w", err)
	}
	var have int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM products`).Scan(&have); err != nil {
		return 0, fmt.Errorf("count products: %w", err)
	}
	created := 0
	for created < n-have {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for i := 0; i < 100 && created < n-have; i++ {
				p, err := RandomProduct(ctx, tx, rng)
				if err != nil {
					return err
				}
				if _, err := CreateProduct(ctx, tx, p); err != nil {
					return err
				}
				created++
			}
			return nil
		})
		if err != nil {
			return created, fmt.Errorf("seed products: %w", err)
		}
	}
	return created, nil
}

// RandomProduct describes a plausible new product with a unique SKU, picking
// an existing brand and category.
func RandomProduct(ctx context.Context, tx pgx.Tx, rng *rand.Rand) (NewProduct, error) {
	var brandID, categoryID int64
	var brand, category string
	err := tx.QueryRow(ctx, `
SELECT b.id, b.name, c.id, c.name
FROM (SELECT id, name FROM brands ORDER BY id OFFSET $1 LIMIT 1) b,
     (SELECT id, name FROM categories ORDER BY id OFFSET $2 LIMIT 1) c`,
		rng.IntN(len(brandNames)), rng.IntN(len(categoryNames))).Scan(&brandID, &brand, &categoryID, &category)
	if err != nil {
		return NewProduct{}, fmt.Errorf("pick brand and category: %w", err)
	}
	model := fmt.Sprintf("%s %d", adjectives[rng.IntN(len(adjectives))], 100+rng.IntN(900))
	ram := []int{4, 8, 16, 32, 64}[rng.IntN(5)]
	storage := []int{64, 128, 256, 512, 1024, 2048}[rng.IntN(6)]
	return NewProduct{
		SKU:         fmt.Sprintf("SKU-%08X%04X", rng.Uint32(), rng.Uint32()&0xffff),
		Name:        fmt.Sprintf("%s %s %s", brand, model, category),
		Description: fmt.Sprintf("The %s %s from %s with %d GB of memory and %d GB of storage.", model, category, brand, ram, storage),
		BrandID:     brandID,
		CategoryID:  categoryID,
		PriceCents:  int64(1000 + rng.IntN(300000)),
		Rating:      float64(rng.IntN(51)) / 10,
		RAMGB:       ram,
		StorageGB:   storage,
		Stock:       rng.IntN(500),
	}, nil
}
