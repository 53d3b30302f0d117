package shop_test

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/fanout/fanout/events"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/schema/pgtest"
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

// An order moves created → paid → shipped → delivered, or is cancelled on
// the way; nothing follows delivered or cancelled. Each transition is a
// numbered row of order_transitions and an order.<status> event carrying
// it, numbered after the events before it in its aggregate.
func TestOrderLifecycle(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 1, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	var productID int64
	if err := db.Pool.QueryRow(ctx, `SELECT min(id) FROM products`).Scan(&productID); err != nil {
		t.Fatal(err)
	}
	newOrder := func() int64 {
		var id int64
		if err := inTx(t, db.Pool, func(tx pgx.Tx) (err error) {
			id, _, err = shop.CreateOrder(ctx, tx, "ada", []shop.OrderLine{{ProductID: productID, Quantity: 1}})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return id
	}
	move := func(write func(context.Context, pgx.Tx, int64) (int64, error), id int64) error {
		return inTx(t, db.Pool, func(tx pgx.Tx) error { _, err := write(ctx, tx, id); return err })
	}
	history := func(id int64) (got []string) {
		rows, err := db.Pool.Query(ctx, `
SELECT t.n || ':' || coalesce(t.from_status, '-') || '>' || t.to_status || ' ' || o.event_type || ' #' || o.aggregate_seq
FROM order_transitions t
JOIN outbox o ON o.aggregate_type = 'order' AND o.aggregate_id = t.order_id::text AND o.aggregate_seq = t.n
WHERE t.order_id = $1 ORDER BY t.n`, id)
		if err != nil {
			t.Fatal(err)
		}
		got, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return got
	}

	delivered := newOrder()
	for _, w := range []func(context.Context, pgx.Tx, int64) (int64, error){shop.PayOrder, shop.ShipOrder, shop.DeliverOrder} {
		if err := move(w, delivered); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{"1:->created order.created #1", "2:created>paid order.paid #2", "3:paid>shipped order.shipped #3", "4:shipped>delivered order.delivered #4"}
	if got := history(delivered); !slices.Equal(got, want) {
		t.Errorf("delivered order's history:\n got %q\nwant %q", got, want)
	}
	if ev := lastEvent(t, db.Pool); ev.eventType != shop.OrderDelivered || ev.payload["from"] != "shipped" || ev.payload["to"] != "delivered" || ev.payload["n"] != 4.0 {
		t.Errorf("order.delivered event: %+v", ev)
	}
	for name, w := range map[string]func(context.Context, pgx.Tx, int64) (int64, error){"cancel": shop.CancelOrder, "pay": shop.PayOrder, "ship": shop.ShipOrder, "deliver": shop.DeliverOrder} {
		if err := move(w, delivered); !errors.Is(err, shop.ErrTransition) {
			t.Errorf("%s a delivered order: %v, want ErrTransition", name, err)
		}
	}

	cancelled := newOrder()
	if err := move(shop.PayOrder, cancelled); err != nil {
		t.Fatal(err)
	}
	if err := move(shop.CancelOrder, cancelled); err != nil {
		t.Fatal(err)
	}
	for name, w := range map[string]func(context.Context, pgx.Tx, int64) (int64, error){"cancel": shop.CancelOrder, "pay": shop.PayOrder, "ship": shop.ShipOrder, "deliver": shop.DeliverOrder} {
		if err := move(w, cancelled); !errors.Is(err, shop.ErrTransition) {
			t.Errorf("%s a cancelled order: %v, want ErrTransition", name, err)
		}
	}
	want = []string{"1:->created order.created #1", "2:created>paid order.paid #2", "3:paid>cancelled order.cancelled #3"}
	if got := history(cancelled); !slices.Equal(got, want) {
		t.Errorf("cancelled order's history:\n got %q\nwant %q", got, want)
	}
	if err := move(shop.ShipOrder, newOrder()); !errors.Is(err, shop.ErrTransition) {
		t.Errorf("ship an unpaid order: %v, want ErrTransition", err)
	}
	if err := move(shop.PayOrder, 999999); !errors.Is(err, shop.ErrNotFound) {
		t.Errorf("pay a missing order: %v, want ErrNotFound", err)
	}
}

// A writer's event that breaks its type's schema is refused before
// anything is sent, naming where and which rule, and the transaction is
// left usable: nothing of the refused write is in Postgres.
func TestAnEventBreakingItsSchemaIsRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 1, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := db.Pool.QueryRow(ctx, `SELECT min(id) FROM products`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	var before int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	err := inTx(t, db.Pool, func(tx pgx.Tx) error {
		_, err := shop.UpdatePrice(ctx, tx, id, -5)
		var invalid *events.InvalidPayload
		if !errors.Is(err, outbox.ErrInvalidEvent) || !errors.As(err, &invalid) {
			t.Fatalf("a negative price: got %v, want ErrInvalidEvent with an *events.InvalidPayload", err)
		}
		if invalid.Type != shop.ProductUpdated || invalid.Pointer != "/price_cents" || invalid.Rule != "minimum" {
			t.Errorf("refused as %+v, want product.updated at /price_cents by minimum", invalid)
		}
		t.Logf("refused: %v", err)
		_, err = shop.UpdatePrice(ctx, tx, id, 1999) // the transaction goes on
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var after int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != before+1 {
		t.Errorf("%d events written, want only the valid one", after-before)
	}
	if price, _, _ := product(t, db.Pool, id); price != 19.99 {
		t.Errorf("price %v, want 19.99", price)
	}
	if e := lastEvent(t, db.Pool); e.payload["price_cents"] != float64(1999) {
		t.Errorf("last event %+v, want the valid price", e)
	}
}

// Every event type the shop writes is declared, and nothing else is.
func TestEveryShopEventTypeIsDeclared(t *testing.T) {
	written := []string{shop.ProductCreated, shop.ProductUpdated, shop.ProductStockChanged, shop.ProductDeleted,
		shop.BrandUpdated, shop.CategoryUpdated, shop.OrderCreated, shop.OrderPaid, shop.OrderShipped, shop.OrderDelivered, shop.OrderCancelled}
	var declared []string
	for _, ty := range shop.EventTypes.Types() {
		declared = append(declared, ty.Name)
		if want := strings.SplitN(ty.Name, ".", 2)[0]; ty.AggregateType != want {
			t.Errorf("%s: aggregate %s, want %s", ty.Name, ty.AggregateType, want)
		}
	}
	slices.Sort(written)
	if !slices.Equal(declared, written) {
		t.Errorf("declared %v, want the types the shop writes: %v", declared, written)
	}
}

// The declarations keep every promise of the released ones: CI fails on a
// change that would break a reader of a released type (a property
// removed, retyped or newly required), which must be a new type instead.
func TestDeclarationsKeepTheReleasedPromises(t *testing.T) {
	released, err := shop.ReleasedEventTypes()
	if err != nil {
		t.Fatal(err)
	}
	if len(released.Types()) == 0 {
		t.Fatal("no released declarations")
	}
	for _, p := range events.BreaksRelease(released, shop.EventTypes) {
		t.Errorf("breaks the released declarations: %s", p)
	}
}
