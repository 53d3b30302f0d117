package subscribers_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// byOrigin records the events it handles by their identity, origin and id.
type byOrigin struct {
	mu   sync.Mutex
	seen map[string]int
}

// byOriginName is its subscriber's name.
const byOriginName = "origins"

func (h *byOrigin) record(ev subscribers.Event) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seen[ev.Origin+":"+strconv.FormatInt(ev.ID, 10)]++
}

func (h *byOrigin) Handle(_ context.Context, ev subscribers.Event) error {
	h.record(ev)
	return nil
}

func (h *byOrigin) count() (events, handled int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, n := range h.seen {
		events, handled = events+1, handled+n
	}
	return events, handled
}

type byOriginTx struct{ *byOrigin }

func (h byOriginTx) HandleTx(_ context.Context, _ pgx.Tx, ev subscribers.Event) error {
	h.record(ev)
	return nil
}

// Checkpoints key on an event's whole identity: event 1 of another
// database, or of a later epoch of this one (a restore), is another event
// than this database's event 1, and each is handled once however often it
// comes.
func TestCheckpointsKeyOnTheEventsOrigin(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"tx", "each"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			env := subscribertest.NewEnv(t)
			h := &byOrigin{seen: map[string]int{}}
			handler := subscribers.Each(h)
			if kind == "tx" {
				handler = subscribers.Tx(byOriginTx{h})
			}
			env.StartRunner(subscribertest.Declare(byOriginName, handler, "thing.>"), nil)
			ids := env.Write(func(pgx.Tx) ([]outbox.Event, error) {
				return []outbox.Event{{AggregateType: "thing", AggregateID: "1", Type: "thing.made", Payload: map[string]int{"n": 1}}}, nil
			})
			id := ids[0]
			subscribertest.WaitFor(t, 20*time.Second, "this database's event handled", func() (bool, string) {
				e, n := h.count()
				return e == 1 && n == 1, fmt.Sprintf("%d events, %d handlings", e, n)
			})

			db, err := outbox.ReadDatabase(context.Background(), env.DB.Pool)
			if err != nil {
				t.Fatal(err)
			}
			other := anotherShop(t, env, db)
			restored := nextEpoch(t, env, db)
			publish := func(origin, msgID string) {
				t.Helper()
				m := nats.NewMsg(env.Config.Stream.SubjectPrefix + ".thing.made")
				m.Data = []byte(`{"n": 1}`)
				m.Header.Set(wire.EventIDHeader, strconv.FormatInt(id, 10))
				m.Header.Set(wire.OriginHeader, origin)
				m.Header.Set(wire.AggregateTypeHeader, "thing")
				m.Header.Set(wire.AggregateIDHeader, "1")
				if _, err := env.JS.PublishMsg(context.Background(), m, jetstream.WithMsgID(msgID)); err != nil {
					t.Fatal(err)
				}
			}
			for round := range 2 {
				// The second time, each is a duplicate of a checkpointed
				// event (a handler of effects outside Postgres may see
				// copies that arrive together twice: it is idempotent).
				for _, o := range []string{other, restored} {
					publish(o, fmt.Sprintf("%s:%d:%d", o, id, round))
				}
				subscribertest.WaitFor(t, 20*time.Second, "both other origins' event 1 handled", func() (bool, string) {
					e, n := h.count()
					return e == 3, fmt.Sprintf("%d events, %d handlings", e, n)
				})
				env.Settle(byOriginName)
			}
			env.Settle(byOriginName)
			if e, n := h.count(); e != 3 || n != 3 {
				t.Fatalf("%d events handled %d times, want 3 events once each: %v", e, n, h.seen)
			}
			store := bookkeeping.New(env.DB.Pool)
			counts, err := store.CheckpointCount(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			rows, origins := counts[byOriginName], 0
			for _, o := range []string{other, restored} {
				if _, ok, err := store.OriginGet(context.Background(), o); err != nil {
					t.Fatal(err)
				} else if ok {
					origins++
				}
			}
			if rows != 3 || origins != 2 {
				t.Fatalf("%d checkpoint rows and %d numbered origins, want 3 and 2", rows, origins)
			}

			// An origin that is no origin is bad input: dead-lettered with
			// the reason, never taken for this database's.
			publish("not an origin", "bad-origin")
			subscribertest.WaitFor(t, 20*time.Second, "the event with a bad origin dead-lettered", func() (bool, string) {
				for _, dl := range env.DeadLetters(byOriginName) {
					if strings.Contains(dl.Header.Get(subscribers.DeadReasonHeader), wire.OriginHeader) {
						return true, ""
					}
				}
				return false, "no letter yet"
			})
			if e, n := h.count(); e != 3 || n != 3 {
				t.Fatalf("after the bad origin: %d events handled %d times, want 3 once each", e, n)
			}
			// So is a database no operator registered: Postgres cannot
			// vouch for it, and it takes none of the origin numbers every
			// subscriber shares.
			publish("7/unregistered/1", "unregistered")
			subscribertest.WaitFor(t, 20*time.Second, "the event of an unregistered database dead-lettered", func() (bool, string) {
				for _, dl := range env.DeadLetters(byOriginName) {
					if strings.Contains(dl.Header.Get(subscribers.DeadReasonHeader), "is not registered (fanout outbox allow-origin)") {
						return true, ""
					}
				}
				return false, "no letter yet"
			})
			if _, ok, err := store.OriginGet(context.Background(), "7/unregistered/1"); err != nil || ok {
				t.Fatalf("the unregistered database's origin numbered: %t (%v)", ok, err)
			}

			// An event that can have no checkpoint key (an id past the
			// room every other origin has) is a verdict on that event:
			// dead-lettered, and the events behind it go on.
			m := nats.NewMsg(env.Config.Stream.SubjectPrefix + ".thing.made")
			m.Data = []byte(`{"n": 1}`)
			m.Header.Set(wire.EventIDHeader, strconv.FormatInt(1<<48, 10))
			m.Header.Set(wire.OriginHeader, other)
			if _, err := env.JS.PublishMsg(context.Background(), m); err != nil {
				t.Fatal(err)
			}
			next := nats.NewMsg(env.Config.Stream.SubjectPrefix + ".thing.made")
			next.Data = []byte(`{"n": 2}`)
			next.Header.Set(wire.EventIDHeader, strconv.FormatInt(id+1, 10))
			next.Header.Set(wire.OriginHeader, other)
			if _, err := env.JS.PublishMsg(context.Background(), next); err != nil {
				t.Fatal(err)
			}
			subscribertest.WaitFor(t, 20*time.Second, "the event without a key dead-lettered, the next one handled", func() (bool, string) {
				lettered := false
				for _, dl := range env.DeadLetters(byOriginName) {
					lettered = lettered || strings.Contains(dl.Header.Get(subscribers.DeadReasonHeader), "2^48")
				}
				e, _ := h.count()
				return lettered && e == 4, fmt.Sprintf("lettered %v, %d events", lettered, e)
			})
		})
	}
}

// orderedByDatabase records, per database, the numbers of aggregate
// thing/1's events in the order it applied them.
type orderedByDatabase struct {
	mu      sync.Mutex
	applied map[string][]int64
}

// declared declares h as an ordered subscriber.
func (h *orderedByDatabase) declared() subscribers.Declaration {
	d := subscribertest.Declare(orderedByDatabaseName, subscribers.Tx(h), "thing.>")
	d.Ordered = true
	return d
}

// orderedByDatabaseName is its subscriber's name.
const orderedByDatabaseName = "ordered_origins"

func (h *orderedByDatabase) HandleTx(_ context.Context, _ pgx.Tx, ev subscribers.Event) error {
	db := ev.Origin[:max(strings.LastIndexByte(ev.Origin, '/'), 0)]
	h.mu.Lock()
	defer h.mu.Unlock()
	h.applied[db] = append(h.applied[db], ev.AggregateSeq)
	return nil
}

func (h *orderedByDatabase) total() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, seqs := range h.applied {
		n += len(seqs)
	}
	return n
}

// An ordered subscriber's per-aggregate checkpoint keys on the database
// too: two databases sharing a stream each have an aggregate thing/1
// numbered 1, 2, 3, and each sequence is applied whole and in order, none
// of the second taken for duplicates or late events of the first.
func TestOrderedCheckpointsKeyOnTheDatabase(t *testing.T) {
	t.Parallel()
	const n = 5
	env := subscribertest.NewEnv(t)
	h := &orderedByDatabase{applied: map[string][]int64{}}
	env.StartRunner(h.declared(), nil)
	for i := range n {
		env.Write(func(pgx.Tx) ([]outbox.Event, error) {
			return []outbox.Event{{AggregateType: "thing", AggregateID: "1", Type: "thing.changed", Payload: map[string]int{"n": i}}}, nil
		})
	}
	subscribertest.WaitFor(t, 20*time.Second, "this database's events applied", func() (bool, string) {
		return h.total() == n, fmt.Sprintf("%d applied", h.total())
	})

	db, err := outbox.ReadDatabase(context.Background(), env.DB.Pool)
	if err != nil {
		t.Fatal(err)
	}
	other := anotherShop(t, env, db)
	publish := func(origin string, id, seq int64) {
		t.Helper()
		m := nats.NewMsg(env.Config.Stream.SubjectPrefix + ".thing.changed")
		m.Data = []byte(`{"n": 1}`)
		m.Header.Set(wire.EventIDHeader, strconv.FormatInt(id, 10))
		m.Header.Set(wire.OriginHeader, origin)
		m.Header.Set(wire.AggregateTypeHeader, "thing")
		m.Header.Set(wire.AggregateIDHeader, "1")
		m.Header.Set(wire.AggregateSeqHeader, strconv.FormatInt(seq, 10))
		if _, err := env.JS.PublishMsg(context.Background(), m, jetstream.WithMsgID(wire.MsgID(origin, id))); err != nil {
			t.Fatal(err)
		}
	}
	for seq := int64(1); seq <= n; seq++ {
		publish(other, seq, seq)
	}
	subscribertest.WaitFor(t, 20*time.Second, "the other database's events applied", func() (bool, string) {
		if dls := env.DeadLetters(orderedByDatabaseName); len(dls) > 0 {
			t.Fatalf("dead-lettered: %s", dls[0].Header.Get(subscribers.DeadReasonHeader))
		}
		return h.total() == 2*n, fmt.Sprintf("%d applied", h.total())
	})
	env.Settle(orderedByDatabaseName)
	h.mu.Lock()
	for _, d := range []string{db.String(), strings.TrimSuffix(other, "/1")} {
		if got := fmt.Sprint(h.applied[d]); got != "[1 2 3 4 5]" {
			t.Errorf("database %s: applied numbers %s of thing/1, want [1 2 3 4 5]", d, got)
		}
	}
	h.mu.Unlock()
	if dls := env.DeadLetters(orderedByDatabaseName); len(dls) > 0 {
		t.Fatalf("dead-lettered: %s", dls[0].Header.Get(subscribers.DeadReasonHeader))
	}

	// This database restored from a backup taken after its number 3:
	// epoch 2's first event of thing/1 is number 4 again. It is not
	// dropped: it goes to the dead letters, and the reason says why.
	publish(nextEpoch(t, env, db), 100, 4)
	subscribertest.WaitFor(t, 20*time.Second, "the restored database's event dead-lettered", func() (bool, string) {
		for _, dl := range env.DeadLetters(orderedByDatabaseName) {
			if reason := dl.Header.Get(subscribers.DeadReasonHeader); strings.Contains(reason, "restored from a backup") {
				t.Logf("reason: %s", reason)
				return true, ""
			}
		}
		return false, "no letter yet"
	})
}

// anotherShop registers another database whose relays share the stream,
// as its operators would (fanout outbox allow-origin), and returns the
// origin of its first epoch.
func anotherShop(t *testing.T, env *subscribertest.Env, own outbox.Database) string {
	t.Helper()
	other := outbox.Database{System: own.System, Name: "another shop"}
	if _, err := outboxstore.New(env.DB.Pool).AllowOrigin(context.Background(), other, "a test"); err != nil {
		t.Fatal(err)
	}
	return outbox.Origin{Database: other, Epoch: 1}.String()
}

// nextEpoch begins this database's epoch 2 after its last id, as its relay
// would after a restore, and returns its origin.
func nextEpoch(t *testing.T, env *subscribertest.Env, own outbox.Database) string {
	t.Helper()
	ctx := context.Background()
	store := outboxstore.New(env.DB.Pool)
	last, err := store.LastID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := store.NewEpoch(ctx, 1, 2, last+1, 0, "a test: a restore"); err != nil || got != 2 {
		t.Fatalf("begin epoch 2: %d, %v", got, err)
	}
	return outbox.Origin{Database: own, Epoch: 2}.String()
}
