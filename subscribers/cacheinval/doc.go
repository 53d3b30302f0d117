// Package cacheinval keeps the Redis product cache honest: Cache is the
// read-through cache the demo reads products through (key product:<id>), and
// Handler is the subscriber that invalidates it on product.*, brand.updated
// and category.updated events (a rename invalidates every product of the
// brand or category).
//
// # Why stale data cannot come back
//
// A cache fill reads the product from Postgres, then writes it to Redis. If
// the product changes in between, the invalidation may land before the
// fill's write, and a plain DEL would let the fill put the old state back
// until the next change. So an invalidation does not delete the key: it
// replaces it with a tombstone that lives for redis.tombstone_ttl (10 s),
// and a fill never overwrites a tombstone. A fill gives up after
// redis.timeout (2 s) and the tombstone outlives twice that, so a fill that
// read the old row can no longer write when the tombstone expires. Fills
// also carry the product version and never replace a newer version with an
// older one, for two fills that race each other. Both checks run in one
// Lua script, atomically in Redis.
package cacheinval
