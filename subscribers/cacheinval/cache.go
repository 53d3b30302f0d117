package cacheinval

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// Key is the cache key of a product.
func Key(productID int64) string { return "product:" + strconv.FormatInt(productID, 10) }

// tombstone is the value of an invalidated key.
const tombstone = "tombstone"

// fillScript writes a product unless the key holds a tombstone or a newer
// version. Values are "<version>\n<json>".
var fillScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if cur then
  if cur == 'tombstone' then return 0 end
  local v = tonumber(string.match(cur, '^(%d+)\n'))
  if v and v >= tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1`)

// Cache is a read-through product cache.
type Cache struct {
	rdb          *redis.Client
	pool         *pgxpool.Pool
	timeout      time.Duration
	ttl          time.Duration
	tombstoneTTL time.Duration
}

// DefaultTTL is how long a filled product stays cached without a change.
const DefaultTTL = 10 * time.Minute

// NewCache returns a cache over rdb that fills from pool. timeout bounds a
// whole fill (read plus write); tombstoneTTL must exceed it (config
// validation checks redis.tombstone_ttl > 2 * redis.timeout).
func NewCache(rdb *redis.Client, pool *pgxpool.Pool, timeout, tombstoneTTL time.Duration) *Cache {
	return &Cache{rdb: rdb, pool: pool, timeout: timeout, ttl: DefaultTTL, tombstoneTTL: tombstoneTTL}
}

// Product returns the product's document, from Redis when cached, else from
// Postgres (and then caches it). found is false if the product does not
// exist.
func (c *Cache) Product(ctx context.Context, id int64) (p shop.Product, found bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	val, err := c.rdb.Get(ctx, Key(id)).Result()
	switch {
	case err == nil && val != tombstone:
		if p, err := decode(val); err == nil {
			return p, true, nil
		}
	case err != nil && err != redis.Nil:
		return shop.Product{}, false, fmt.Errorf("cache get product %d: %w", id, err)
	}
	products, err := shop.LoadProducts(ctx, c.pool, []int64{id})
	if err != nil {
		return shop.Product{}, false, err
	}
	p, found = products[id]
	if !found {
		return shop.Product{}, false, nil
	}
	if _, err := c.fill(ctx, p); err != nil {
		return p, true, fmt.Errorf("cache fill product %d: %w", id, err)
	}
	return p, true, nil
}

// fill writes p unless a tombstone or a newer version is there; it reports
// whether it wrote.
func (c *Cache) fill(ctx context.Context, p shop.Product) (bool, error) {
	doc, err := json.Marshal(p)
	if err != nil {
		return false, err
	}
	val := strconv.FormatInt(p.Version, 10) + "\n" + string(doc)
	n, err := fillScript.Run(ctx, c.rdb, []string{Key(p.ID)}, val, p.Version, c.ttl.Milliseconds()).Int()
	return n == 1, err
}

// Ping checks that Redis answers, within redis.timeout.
func (c *Cache) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	return c.rdb.Ping(ctx).Err()
}

// Invalidate replaces the products' keys with tombstones.
func (c *Cache) Invalidate(ctx context.Context, ids ...int64) error {
	if len(ids) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	_, err := c.rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for _, id := range ids {
			pipe.Set(ctx, Key(id), tombstone, c.tombstoneTTL)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("invalidate %d products: %w", len(ids), err)
	}
	return nil
}

// Cached returns what the cache holds for a product: the document, a
// tombstone, or nothing. Tests and checks use it.
func (c *Cache) Cached(ctx context.Context, id int64) (p shop.Product, isTombstone, present bool, err error) {
	val, err := c.rdb.Get(ctx, Key(id)).Result()
	if err == redis.Nil {
		return shop.Product{}, false, false, nil
	}
	if err != nil {
		return shop.Product{}, false, false, err
	}
	if val == tombstone {
		return shop.Product{}, true, true, nil
	}
	p, err = decode(val)
	return p, false, true, err
}

func decode(val string) (shop.Product, error) {
	_, doc, ok := strings.Cut(val, "\n")
	if !ok {
		return shop.Product{}, fmt.Errorf("cached value without a version line")
	}
	var p shop.Product
	err := json.Unmarshal([]byte(doc), &p)
	return p, err
}
