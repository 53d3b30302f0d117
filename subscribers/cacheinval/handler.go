package cacheinval

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Name is the subscriber's durable name.
const Name = "cacheinval"

// Handler invalidates cached products.
type Handler struct {
	cache *Cache
	pool  *pgxpool.Pool
}

// New returns the cache invalidator.
func New(cache *Cache, pool *pgxpool.Pool) *Handler { return &Handler{cache: cache, pool: pool} }

// Dependency is Redis's name among the invalidator's dependencies.
const Dependency = "redis"

// Dependencies: Redis, probed with PING.
func (h *Handler) Dependencies() []subscribers.Dependency {
	return []subscribers.Dependency{{Name: Dependency, Probe: h.cache.Ping}}
}

// Subscriber declares the cache invalidator to fanout.
var Subscriber = subscribers.Declaration{
	Name: Name,
	// Every product change, and brand and category renames (their
	// names are in each of their products' documents).
	EventTypes: []string{"product.>", shop.BrandUpdated, shop.CategoryUpdated},
	Uses:       []subscribers.Service{subscribers.Redis},
	// It reads the products a rename touches; the cache itself fills from
	// the catalog (see Cache).
	Grants: []string{"SELECT ON products, brands, categories, inventory"},
	New: func(d subscribers.Deps) (subscribers.Handler, error) {
		var redis struct {
			Timeout      time.Duration `koanf:"timeout"`
			TombstoneTTL time.Duration `koanf:"tombstone_ttl"`
		}
		if err := d.Settings.Section("redis", &redis); err != nil {
			return subscribers.Handler{}, err
		}
		return subscribers.Each(New(NewCache(d.Redis, d.Pool, redis.Timeout, redis.TombstoneTTL), d.Pool)), nil
	},
}

// Handle invalidates the products the event changed.
func (h *Handler) Handle(ctx context.Context, ev subscribers.Event) error {
	switch ev.Type {
	case shop.BrandUpdated:
		var p shop.BrandEvent
		if err := json.Unmarshal(ev.Payload, &p); err != nil || p.BrandID <= 0 {
			return subscribers.Permanent(fmt.Errorf("malformed brand.updated payload %q: %v", ev.Payload, err))
		}
		return h.invalidateGroup(ctx, `SELECT id FROM products WHERE brand_id = $1`, "brand", p.BrandID)
	case shop.CategoryUpdated:
		var p shop.CategoryEvent
		if err := json.Unmarshal(ev.Payload, &p); err != nil || p.CategoryID <= 0 {
			return subscribers.Permanent(fmt.Errorf("malformed category.updated payload %q: %v", ev.Payload, err))
		}
		return h.invalidateGroup(ctx, `SELECT id FROM products WHERE category_id = $1`, "category", p.CategoryID)
	default:
		var p shop.ProductEvent
		if err := json.Unmarshal(ev.Payload, &p); err != nil {
			return subscribers.Permanent(fmt.Errorf("malformed %s payload %q: %v", ev.Type, ev.Payload, err))
		}
		id := p.ProductID
		if id <= 0 {
			// Any product event names its product as the aggregate.
			id, _ = strconv.ParseInt(ev.AggregateID, 10, 64)
		}
		if id <= 0 {
			return subscribers.Permanent(fmt.Errorf("%s event names no product (payload %q, aggregate %q)", ev.Type, ev.Payload, ev.AggregateID))
		}
		return invalidate(ctx, h.cache, id)
	}
}

// invalidateGroup invalidates every product of a renamed brand or category,
// as query (taking the group's id) lists them: each cached copy carries the
// old name.
func (h *Handler) invalidateGroup(ctx context.Context, query, group string, id int64) error {
	rows, err := h.pool.Query(ctx, query, id)
	if err != nil {
		return fmt.Errorf("products of %s %d: %w", group, id, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("products of %s %d: %w", group, id, err)
	}
	return invalidate(ctx, h.cache, ids...)
}

// invalidate writes the tombstones. Whatever fails there is Redis's state,
// not the event's (a SET cannot fail on its value).
func invalidate(ctx context.Context, c *Cache, ids ...int64) error {
	return subscribers.Unavailable(Dependency, c.Invalidate(ctx, ids...))
}
