package subscribers

// Checkpoints key on an event's whole identity: its origin (database and
// outbox epoch, the Fanout-Origin header) and its id. The key of an event
// of the subscriber's own database's first epoch, nearly every event, is
// its id, as it was before events carried their origin, so the tables
// keyed on event_id keep their rows. Any other origin has a number in
// event_origins (schema migration 00015), and its events the key
// number<<originShift | id: another database's event 42, or the event 42
// a restored database wrote again, is not taken for this one's.

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5/pgxpool"
)

// originShift leaves ids below 2^48 (281 trillion) to every origin.
const originShift = 48

// originKeys numbers origins, once each per process.
type originKeys struct {
	pool  *pgxpool.Pool
	own   string // this database's first epoch: keys are plain ids
	ownDB string // this database, as an origin names it
	mu    sync.Mutex
	nums  map[string]int64
}

const originNumSQL = `
WITH ins AS (
    INSERT INTO event_origins (origin) VALUES ($1) ON CONFLICT (origin) DO NOTHING RETURNING num
)
SELECT num FROM ins UNION ALL SELECT num FROM event_origins WHERE origin = $1`

// key returns the checkpoint key of the event (origin, id).
func (k *originKeys) key(ctx context.Context, origin string, id int64) (int64, error) {
	if origin == "" || origin == k.own {
		return id, nil
	}
	if id >= 1<<originShift {
		return 0, fmt.Errorf("event %d of origin %s: ids of another origin than this database's first epoch must be below 2^%d", id, origin, originShift)
	}
	k.mu.Lock()
	num, ok := k.nums[origin]
	k.mu.Unlock()
	if !ok {
		if err := k.pool.QueryRow(ctx, originNumSQL, origin).Scan(&num); err != nil {
			return 0, fmt.Errorf("number origin %s in event_origins: %w", origin, err)
		}
		k.mu.Lock()
		k.nums[origin] = num
		k.mu.Unlock()
	}
	return num<<originShift | id, nil
}

// keyEvents gives each delivery its checkpoint key; an error is Postgres's
// (an outage), never the events'.
func (r *Runner) keyEvents(ctx context.Context, ds []*delivery) error {
	if r.origins == nil { // a runner that did not start: a redrive's
		db, err := outbox.ReadDatabase(ctx, r.opts.Pool)
		if err != nil {
			return err
		}
		r.origins = newOriginKeys(r.opts.Pool, db)
	}
	for _, d := range ds {
		if d.ev.ckey != 0 || d.deadReason != "" {
			continue
		}
		ctx, cancel := r.bookkeeping(ctx)
		key, err := r.origins.key(ctx, d.ev.Origin, d.ev.ID)
		cancel()
		if err != nil {
			return err
		}
		d.ev.ckey = key
		for _, dup := range d.dups {
			dup.ev.ckey = key
		}
	}
	return nil
}

func newOriginKeys(pool *pgxpool.Pool, db outbox.Database) *originKeys {
	return &originKeys{pool: pool, own: outbox.Origin{Database: db, Epoch: 1}.String(), ownDB: db.String(), nums: map[string]int64{}}
}

// database is the database part of an ordered checkpoint's key for an
// event of origin: "" for this database (and for an event that names
// none), else the origin's database (schema migration 00016). Epochs
// are left out: a restored database's aggregates number on from the
// backup's counters.
func (k *originKeys) database(origin string) string {
	i := strings.LastIndexByte(origin, '/')
	if i < 0 || origin[:i] == k.ownDB {
		return ""
	}
	return origin[:i]
}
