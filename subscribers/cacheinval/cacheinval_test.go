package cacheinval_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/redistest"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type fixture struct {
	env   *subscribertest.Env
	rdb   *redis.Client
	cache *cacheinval.Cache
}

func newFixture(env *subscribertest.Env) *fixture {
	srv := redistest.Start(env.T)
	f := &fixture{env: env, rdb: srv.Client(env.T)}
	f.cache = cacheinval.NewCache(f.rdb, env.DB.Pool, 2*time.Second, time.Minute) // tombstones outlive any test
	// The catalog is written without events: the product events a test
	// sees are the ones it writes.
	_, err := env.DB.Pool.Exec(context.Background(), `
WITH b AS (INSERT INTO brands (name) VALUES ('Acme'), ('Globex') RETURNING id),
     c AS (INSERT INTO categories (name) VALUES ('phones') RETURNING id),
     p AS (
        INSERT INTO products (sku, name, brand_id, category_id, price)
        SELECT 'SKU-' || g, 'Product ' || g, (SELECT min(id) FROM b) + g % 2, (SELECT id FROM c), 10 + g
        FROM generate_series(1, 5) g
        RETURNING id)
INSERT INTO inventory (product_id, stock) SELECT id, 10 FROM p`)
	if err != nil {
		env.T.Fatal(err)
	}
	return f
}

func firstProduct(t *testing.T, env *subscribertest.Env) int64 {
	var id int64
	if err := env.DB.Pool.QueryRow(context.Background(), `SELECT min(id) FROM products`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

func TestConformance(t *testing.T) {
	fx := map[*subscribertest.Env]*fixture{}
	get := func(env *subscribertest.Env) *fixture {
		if f, ok := fx[env]; ok {
			return f
		}
		f := newFixture(env)
		fx[env] = f
		return f
	}
	// The suite's subtests run in parallel, each with its own env.
	var mu = make(chan struct{}, 1)
	lock := func() func() { mu <- struct{}{}; return func() { <-mu } }
	subscribertest.Run(t, subscribertest.Case{
		Subscriber: cacheinval.Subscriber,
		Handler: func(env *subscribertest.Env) subscribers.Handler {
			defer lock()()
			f := get(env)
			return subscribers.Each(cacheinval.New(f.cache, env.DB.Pool))
		},
		Valid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, error) {
			defer lock()()
			f := get(env)
			id := firstProduct(env.T, env)
			// Cache the product, so the event has something to invalidate.
			if _, _, err := f.cache.Product(context.Background(), id); err != nil {
				return outbox.Event{}, err
			}
			price := int64(4242)
			return outbox.Event{AggregateType: "product", AggregateID: strconv.FormatInt(id, 10), Type: shop.ProductUpdated,
				Payload: shop.ProductEvent{ProductID: id, PriceCents: &price}}, nil
		},
		Effects: func(env *subscribertest.Env, ev outbox.Event, _ int64) int {
			defer lock()()
			f := get(env)
			_, tomb, _, err := f.cache.Cached(context.Background(), ev.Payload.(shop.ProductEvent).ProductID)
			if err != nil {
				env.T.Fatal(err)
			}
			if tomb {
				return 1
			}
			return 0
		},
		Invalid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, string, error) {
			return outbox.Event{AggregateType: "product", AggregateID: "none", Type: shop.ProductUpdated,
				Payload: []byte(`{"price_cents": 5}`)}, "names no product", nil
		},
	})
}

func TestProductAndBrandEventsInvalidate(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	f := newFixture(env)
	env.StartRunner(subscribertest.HandledBy(cacheinval.Subscriber, subscribers.Each(cacheinval.New(f.cache, env.DB.Pool))), nil)
	ctx := context.Background()

	var all []int64
	rows, _ := env.DB.Pool.Query(ctx, `SELECT id FROM products ORDER BY id`)
	all, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range all {
		if _, _, err := f.cache.Product(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	// A price change through the real writer invalidates that product only.
	target := all[0]
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		_, err := shop.UpdatePrice(ctx, tx, target, 777)
		return nil, err
	})
	subscribertest.WaitFor(t, 10*time.Second, "the product invalidated", func() (bool, string) {
		_, tomb, _, _ := f.cache.Cached(ctx, target)
		return tomb, ""
	})
	if _, tomb, present, _ := f.cache.Cached(ctx, all[1]); tomb || !present {
		t.Errorf("product %d: tombstone %v present %v, want it still cached", all[1], tomb, present)
	}
	// While the tombstone lives, reads go to Postgres and see the new price.
	p, found, err := f.cache.Product(ctx, target)
	if err != nil || !found || p.PriceCents != 777 {
		t.Errorf("read after invalidation: %+v found %v err %v", p, found, err)
	}

	// A brand rename invalidates every product of the brand.
	var brandID int64
	if err := env.DB.Pool.QueryRow(ctx, `SELECT brand_id FROM products WHERE id = $1`, all[1]).Scan(&brandID); err != nil {
		t.Fatal(err)
	}
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		_, err := shop.RenameBrand(ctx, tx, brandID, "Brand New")
		return nil, err
	})
	rows, _ = env.DB.Pool.Query(ctx, `SELECT id FROM products WHERE brand_id = $1`, brandID)
	ofBrand, _ := pgx.CollectRows(rows, pgx.RowTo[int64])
	subscribertest.WaitFor(t, 10*time.Second, "the brand's products invalidated", func() (bool, string) {
		for _, id := range ofBrand {
			if _, tomb, _, _ := f.cache.Cached(ctx, id); !tomb {
				return false, "product " + strconv.FormatInt(id, 10) + " still cached"
			}
		}
		return true, ""
	})
}

// The race the tombstone exists for: a fill reads the old row, the product
// changes and is invalidated, then the fill writes. The old state must not
// come back.
func TestStaleFillCannotOverwriteInvalidation(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	f := newFixture(env)
	ctx := context.Background()
	id := firstProduct(t, env)

	old, err := shop.LoadProducts(ctx, env.DB.Pool, []int64{id})
	if err != nil {
		t.Fatal(err)
	}
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		_, err := shop.UpdatePrice(ctx, tx, id, 999)
		return nil, err
	})
	if err := f.cache.Invalidate(ctx, id); err != nil {
		t.Fatal(err)
	}
	if wrote, err := cacheinval.FillForTest(ctx, f.cache, old[id]); err != nil || wrote {
		t.Fatalf("stale fill over a tombstone: wrote %v, err %v; want refused", wrote, err)
	}
	// After the tombstone, a fresh fill wins; an older one cannot replace it.
	f.rdb.Del(ctx, cacheinval.Key(id))
	fresh, _ := shop.LoadProducts(ctx, env.DB.Pool, []int64{id})
	if wrote, err := cacheinval.FillForTest(ctx, f.cache, fresh[id]); err != nil || !wrote {
		t.Fatalf("fresh fill: wrote %v, err %v", wrote, err)
	}
	if wrote, _ := cacheinval.FillForTest(ctx, f.cache, old[id]); wrote {
		t.Fatal("an older version replaced a newer one")
	}
	p, _, _, _ := f.cache.Cached(ctx, id)
	if p.Version != fresh[id].Version || p.PriceCents != 999 {
		t.Errorf("cached %+v, want version %d at 999", p, fresh[id].Version)
	}
}

// A category rename invalidates every cached product of the category (each
// carries the old name) and no other.
func TestCategoryRenameInvalidatesItsProducts(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	f := newFixture(env)
	env.StartRunner(subscribertest.HandledBy(cacheinval.Subscriber, subscribers.Each(cacheinval.New(f.cache, env.DB.Pool))), nil)
	ctx := context.Background()
	// A second category, holding every other product (behind fanout's
	// back: no event, nothing invalidated).
	var phones, laptops int64
	if err := env.DB.Pool.QueryRow(ctx, `SELECT id FROM categories WHERE name = 'phones'`).Scan(&phones); err != nil {
		t.Fatal(err)
	}
	if err := env.DB.Pool.QueryRow(ctx, `INSERT INTO categories (name) VALUES ('laptops') RETURNING id`).Scan(&laptops); err != nil {
		t.Fatal(err)
	}
	if _, err := env.DB.Pool.Exec(ctx, `UPDATE products SET category_id = $1 WHERE id % 2 = 0`, laptops); err != nil {
		t.Fatal(err)
	}
	ofCategory := func(id int64) []int64 {
		rows, _ := env.DB.Pool.Query(ctx, `SELECT id FROM products WHERE category_id = $1 ORDER BY id`, id)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	renamed, others := ofCategory(phones), ofCategory(laptops)
	if len(renamed) == 0 || len(others) == 0 {
		t.Fatalf("products: %v in phones, %v in laptops; want some in each", renamed, others)
	}
	for _, id := range append(append([]int64{}, renamed...), others...) {
		if _, _, err := f.cache.Product(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	var renamedEvent int64
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		var err error
		renamedEvent, err = shop.RenameCategory(ctx, tx, phones, "smartphones")
		return nil, err
	})
	subscribertest.WaitFor(t, 10*time.Second, "the category's products invalidated", func() (bool, string) {
		for _, id := range renamed {
			if _, tomb, _, _ := f.cache.Cached(ctx, id); !tomb {
				return false, "product " + strconv.FormatInt(id, 10) + " still cached"
			}
		}
		return true, ""
	})
	env.WaitSent(renamedEvent)
	env.WaitIdle(cacheinval.Name, 10*time.Second)
	for _, id := range others {
		if p, tomb, present, err := f.cache.Cached(ctx, id); err != nil || tomb || !present || p.Category != "laptops" {
			t.Errorf("product %d of another category: tombstone %v, present %v, %+v, %v; want it still cached", id, tomb, present, p, err)
		}
	}
	// Reads of the renamed category's products go to Postgres and see the
	// new name.
	for _, id := range renamed {
		if p, found, err := f.cache.Product(ctx, id); err != nil || !found || p.Category != "smartphones" {
			t.Errorf("read of product %d after the rename: %+v, found %v, %v; want category smartphones", id, p, found, err)
		}
	}
	if n := len(env.DeadLetters(cacheinval.Name)); n != 0 {
		t.Errorf("%d dead letters, want none", n)
	}
}
