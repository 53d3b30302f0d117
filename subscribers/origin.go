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
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// originShift leaves ids below 2^48 (281 trillion) to every origin.
const originShift = 48

// originKeys numbers origins, once each per process, and gives events
// their checkpoint keys.
type originKeys struct {
	store   bookkeeping.Store
	pool    *pgxpool.Pool // where the database's own identity is read
	timeout time.Duration // subscribers.handler_timeout: see bounded
	// own and ownDB are set (known) by the runner's start, or by a
	// redrive's first keyEvents: this database's first epoch (its events'
	// keys are plain ids), and this database as an origin names it.
	own, ownDB string
	known      bool
	mu         sync.Mutex
	nums       map[string]int64
}

func newOriginKeys(store bookkeeping.Store, pool *pgxpool.Pool, timeout time.Duration) *originKeys {
	return &originKeys{store: store, pool: pool, timeout: timeout, nums: map[string]int64{}}
}

// setDatabase records the identity of the subscriber's own database.
func (k *originKeys) setDatabase(db outbox.Database) {
	k.own, k.ownDB, k.known = outbox.Origin{Database: db, Epoch: 1}.String(), db.String(), true
}

// errNoKey is a verdict on one event: no checkpoint key can be made for it
// (its id is too large for its origin, or every origin number is taken).
// The event is dead-lettered with the reason; the others go on.
type errNoKey struct{ reason string }

func (e *errNoKey) Error() string { return e.reason }

// key returns the checkpoint key of the event (origin, id).
func (k *originKeys) key(ctx context.Context, origin string, id int64) (int64, error) {
	if origin == "" || origin == k.own {
		return id, nil
	}
	if id >= 1<<originShift || id < 0 {
		return 0, &errNoKey{fmt.Sprintf("event %d of origin %s: the ids of an origin other than this database's first epoch must lie between 0 and 2^%d", id, origin, originShift)}
	}
	k.mu.Lock()
	num, ok := k.nums[origin]
	k.mu.Unlock()
	if !ok {
		n, ok, err := k.store.OriginNumber(ctx, origin)
		if err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "22023" /* invalid_parameter_value: not an origin */ {
				return 0, &errNoKey{fmt.Sprintf("event %d: %s", id, pgErr.Message)}
			}
			return 0, fmt.Errorf("number origin %s in event_origins: %w", origin, err)
		}
		if !ok {
			return 0, &errNoKey{fmt.Sprintf("event %d of origin %s: event_origins has numbered the most origins it can (32767): this one cannot be checkpointed", id, origin)}
		}
		num = n
		k.mu.Lock()
		k.nums[origin] = num
		k.mu.Unlock()
	}
	return num<<originShift | id, nil
}

// keyEvents gives each delivery its checkpoint key. An event that can have
// none is marked for the dead letters; an error is Postgres's (an outage),
// never the events'.
func (k *originKeys) keyEvents(ctx context.Context, ds []*delivery) error {
	if !k.known { // a runner that did not start: a redrive's
		db, err := outbox.ReadDatabase(ctx, k.pool)
		if err != nil {
			return err
		}
		k.setDatabase(db)
	}
	for _, d := range ds {
		if d.ev.ckey != 0 || d.deadReason != "" {
			continue
		}
		ctx, cancel := context.WithTimeout(ctx, k.timeout)
		key, err := k.key(ctx, d.ev.Origin, d.ev.ID)
		cancel()
		var noKey *errNoKey
		if errors.As(err, &noKey) {
			d.deadReason = noKey.reason
			continue
		}
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

// CheckpointKey is the key under which subscribers checkpoint the event
// (origin, id) of a database whose own identity is db, as the operator
// tools look it up; false when no subscriber has checkpointed an event of
// that origin yet (it has no number).
func CheckpointKey(ctx context.Context, q bookkeeping.DB, db outbox.Database, origin string, id int64) (int64, bool, error) {
	if origin == "" || origin == (outbox.Origin{Database: db, Epoch: 1}).String() {
		return id, true, nil
	}
	num, ok, err := bookkeeping.New(q).OriginGet(ctx, origin)
	if err != nil {
		return 0, false, fmt.Errorf("look up origin %s in event_origins: %w", origin, err)
	}
	if !ok {
		return 0, false, nil
	}
	return num<<originShift | id, true, nil
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
