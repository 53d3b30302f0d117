package shop_test

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/fanout/fanout/internal/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

type outboxRow struct {
	eventType, aggregateType, aggregateID string
	payload                               map[string]any
}

func lastEvent(t *testing.T, pool *pgxpool.Pool) outboxRow {
	t.Helper()
	var r outboxRow
	var payload []byte
	err := pool.QueryRow(context.Background(), `SELECT event_type, aggregate_type, aggregate_id, payload FROM outbox ORDER BY id DESC LIMIT 1`).
		Scan(&r.eventType, &r.aggregateType, &r.aggregateID, &payload)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(payload, &r.payload); err != nil {
		t.Fatal(err)
	}
	return r
}

func product(t *testing.T, pool *pgxpool.Pool, id int64) (price float64, stock int, version int64) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `
SELECT p.price::float8, i.stock, p.version FROM products p JOIN inventory i ON i.product_id = p.id WHERE p.id = $1`, id).
		Scan(&price, &stock, &version)
	if err != nil {
		t.Fatal(err)
	}
	return
}

func inTx(t *testing.T, pool *pgxpool.Pool, fn func(tx pgx.Tx) error) error {
	t.Helper()
	return pgx.BeginFunc(context.Background(), pool, fn)
}

func TestWritersChangeRowsBumpVersionsAndRecordEvents(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 3, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	var id, brandID int64
	if err := db.Pool.QueryRow(ctx, `SELECT id, brand_id FROM products ORDER BY id LIMIT 1`).Scan(&id, &brandID); err != nil {
		t.Fatal(err)
	}
	_, stock0, v0 := product(t, db.Pool, id)

	if err := inTx(t, db.Pool, func(tx pgx.Tx) error { _, err := shop.UpdatePrice(ctx, tx, id, 12345); return err }); err != nil {
		t.Fatal(err)
	}
	price, _, v1 := product(t, db.Pool, id)
	ev := lastEvent(t, db.Pool)
	if price != 123.45 || v1 != v0+1 || ev.eventType != shop.ProductUpdated || ev.payload["price_cents"] != 12345.0 || ev.aggregateType != "product" {
		t.Errorf("UpdatePrice: price %v version %d→%d event %+v", price, v0, v1, ev)
	}

	if err := inTx(t, db.Pool, func(tx pgx.Tx) error { _, err := shop.ChangeStock(ctx, tx, id, -(stock0 + 10)); return err }); err != nil {
		t.Fatal(err)
	}
	_, stock, v2 := product(t, db.Pool, id)
	if stock != 0 || v2 != v1+1 || lastEvent(t, db.Pool).eventType != shop.ProductStockChanged {
		t.Errorf("ChangeStock below zero: stock %d version %d, want 0 and %d", stock, v2, v1+1)
	}

	var siblings int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM products WHERE brand_id = $1`, brandID).Scan(&siblings); err != nil {
		t.Fatal(err)
	}
	if err := inTx(t, db.Pool, func(tx pgx.Tx) error { _, err := shop.RenameBrand(ctx, tx, brandID, "Renamed Co"); return err }); err != nil {
		t.Fatal(err)
	}
	_, _, v3 := product(t, db.Pool, id)
	ev = lastEvent(t, db.Pool)
	if v3 != v2+1 || ev.eventType != shop.BrandUpdated || ev.payload["name"] != "Renamed Co" || ev.payload["products"] != float64(siblings) {
		t.Errorf("RenameBrand: version %d, event %+v", v3, ev)
	}

	var orderID int64
	if err := inTx(t, db.Pool, func(tx pgx.Tx) error {
		var err error
		orderID, _, err = shop.CreateOrder(ctx, tx, "alice", []shop.OrderLine{{ProductID: id, Quantity: 2}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var unitPrice float64
	if err := db.Pool.QueryRow(ctx, `SELECT unit_price::float8 FROM order_lines WHERE order_id = $1`, orderID).Scan(&unitPrice); err != nil || unitPrice != 123.45 {
		t.Errorf("order line unit price %v, %v; want the product's price", unitPrice, err)
	}
	if ev := lastEvent(t, db.Pool); ev.eventType != shop.OrderCreated || ev.payload["order_id"] != float64(orderID) {
		t.Errorf("CreateOrder event %+v", ev)
	}

	if err := inTx(t, db.Pool, func(tx pgx.Tx) error { _, err := shop.DeleteProduct(ctx, tx, id); return err }); err != nil {
		t.Fatal(err)
	}
	if ev := lastEvent(t, db.Pool); ev.eventType != shop.ProductDeleted || ev.payload["version"] != float64(v3) {
		t.Errorf("DeleteProduct event %+v, want the last version %d", ev, v3)
	}
}

// A writer whose target is missing returns ErrNotFound; the caller's
// transaction rolls back and no event survives.
func TestMissingTargetsWriteNoEvent(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 1, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	var before int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	for name, write := range map[string]func(tx pgx.Tx) error{
		"UpdatePrice":   func(tx pgx.Tx) error { _, err := shop.UpdatePrice(ctx, tx, 999999, 1); return err },
		"ChangeStock":   func(tx pgx.Tx) error { _, err := shop.ChangeStock(ctx, tx, 999999, 1); return err },
		"DeleteProduct": func(tx pgx.Tx) error { _, err := shop.DeleteProduct(ctx, tx, 999999); return err },
		"RenameBrand":   func(tx pgx.Tx) error { _, err := shop.RenameBrand(ctx, tx, 999999, "x"); return err },
		"RenameCategory": func(tx pgx.Tx) error {
			_, err := shop.RenameCategory(ctx, tx, 999999, "x")
			return err
		},
		"CreateOrder": func(tx pgx.Tx) error {
			_, _, err := shop.CreateOrder(ctx, tx, "bob", []shop.OrderLine{{ProductID: 999999, Quantity: 1}})
			return err
		},
	} {
		if err := inTx(t, db.Pool, write); !errors.Is(err, shop.ErrNotFound) {
			t.Errorf("%s of a missing target: %v, want ErrNotFound", name, err)
		}
	}
	var after int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&after); err != nil || after != before {
		t.Errorf("outbox rows %d → %d after failed writes", before, after)
	}
}

// A category rename changes the name every product document of the
// category shows, so it bumps the version of exactly those products, in the
// rename's transaction, and records category.updated with the category id.
func TestRenameCategoryBumpsItsProducts(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 40, rand.New(rand.NewPCG(2, 7))); err != nil {
		t.Fatal(err)
	}
	versions := func() map[int64][2]int64 { // product id -> category id, version
		rows, _ := db.Pool.Query(ctx, `SELECT id, category_id, version FROM products`)
		out := map[int64][2]int64{}
		var id, cat, v int64
		if _, err := pgx.ForEachRow(rows, []any{&id, &cat, &v}, func() error { out[id] = [2]int64{cat, v}; return nil }); err != nil {
			t.Fatal(err)
		}
		return out
	}
	var categoryID int64
	var inCategory int
	if err := db.Pool.QueryRow(ctx, `SELECT category_id, count(*) FROM products GROUP BY category_id ORDER BY count(*) DESC LIMIT 1`).
		Scan(&categoryID, &inCategory); err != nil {
		t.Fatal(err)
	}
	before := versions()
	if len(before) == inCategory {
		t.Fatal("every product is in one category: the test cannot tell the category's products from the others")
	}
	if err := inTx(t, db.Pool, func(tx pgx.Tx) error {
		_, err := shop.RenameCategory(ctx, tx, categoryID, "gadgets")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	for id, now := range versions() {
		want := before[id][1]
		if now[0] == categoryID {
			want++
		}
		if now[1] != want {
			t.Errorf("product %d (category %d): version %d → %d, want %d", id, now[0], before[id][1], now[1], want)
		}
	}
	ev := lastEvent(t, db.Pool)
	if ev.eventType != shop.CategoryUpdated || ev.aggregateType != shop.AggregateCategory || ev.aggregateID != strconv.FormatInt(categoryID, 10) ||
		ev.payload["category_id"] != float64(categoryID) || ev.payload["name"] != "gadgets" || ev.payload["products"] != float64(inCategory) {
		t.Errorf("RenameCategory event %+v, want category.updated for category %d with %d products", ev, categoryID, inCategory)
	}
	// The documents, as the indexer and the cache read them, carry the new
	// name under the new version.
	var ids []int64
	for id, v := range before {
		if v[0] == categoryID {
			ids = append(ids, id)
		}
	}
	docs, err := shop.LoadProducts(ctx, db.Pool, ids)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if p := docs[id]; p.Category != "gadgets" || p.Version != before[id][1]+1 {
			t.Errorf("product %d's document: category %q at version %d, want gadgets at %d", id, p.Category, p.Version, before[id][1]+1)
		}
	}
}
