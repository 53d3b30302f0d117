package subscribertest

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
)

// Case describes a subscriber to the conformance suite.
type Case struct {
	// Subscriber is the subscriber, as its package declares it.
	Subscriber subscribers.Declaration
	// Handler, if set, builds its handler on env's database (with the
	// test's own fixtures: a cache, an index); else its declaration's New
	// does.
	Handler func(env *Env) subscribers.Handler
	// Valid writes the business rows a valid event needs, inside tx, and
	// returns the event.
	Valid func(env *Env, tx pgx.Tx) (outbox.Event, error)
	// Effects counts the effect a valid event had: 1 when handled, however
	// often it was delivered. ev is the event Valid returned, id its event
	// id (the outbox id: Event.ID as the handler got it), so that a case
	// can look for the effect of this very event where its subscriber
	// records the id.
	Effects func(env *Env, ev outbox.Event, id int64) int
	// Invalid returns an event the handler must send to the dead letters,
	// and a substring of the reason it must give.
	Invalid func(env *Env, tx pgx.Tx) (ev outbox.Event, reason string, err error)
	// CheckpointOnly declares an effect that is exactly once only through
	// the checkpoint committed in its transaction (a TxHandler whose effect
	// adds up, like a ledger), not idempotent by itself. The suite then
	// checks that the handler is a TxHandler and that, with the checkpoint
	// deleted, a redelivery does take effect again: proof that the
	// idempotence check would catch a second handling.
	CheckpointOnly bool
}

// Run is the conformance suite. Each subtest has its own database,
// nats-server and relay, and runs in parallel with the others.
func Run(t *testing.T, c Case) {
	t.Run("HandledOnceAndCheckpointed", func(t *testing.T) { handledOnceAndCheckpointed(t, c) })
	t.Run("DuplicateEventIDHasNoSecondEffect", func(t *testing.T) { duplicateEventIDHasNoSecondEffect(t, c) })
	t.Run("IdempotentUnderRedelivery", func(t *testing.T) { idempotentUnderRedelivery(t, c) })
	t.Run("PermanentErrorReachesDeadLettersWithReason", func(t *testing.T) { permanentErrorReachesDeadLettersWithReason(t, c) })
	t.Run("CancelledContextStopsWork", func(t *testing.T) { cancelledContextStopsWork(t, c) })
}

// handledOnceAndCheckpointed: one valid event takes effect once and is
// checkpointed.
func handledOnceAndCheckpointed(t *testing.T, c Case) {
	t.Parallel()
	env := NewEnv(t)
	h, calls := counted(c.handler(env))
	env.StartRunner(HandledBy(c.Subscriber, h), nil)
	ev, id := writeValid(env, c)
	waitCheckpointed(env, c.Subscriber.Name, id)
	env.WaitIdle(c.Subscriber.Name, 10*time.Second)
	if n := c.Effects(env, ev, id); n != 1 {
		t.Errorf("effects = %d, want 1", n)
	}
	if n := calls.of(id); n != 1 {
		t.Errorf("handler called %d times for one event", n)
	}
}

// duplicateEventIDHasNoSecondEffect: the same event id stored twice in
// the stream takes effect once.
func duplicateEventIDHasNoSecondEffect(t *testing.T, c Case) {
	t.Parallel()
	env := NewEnv(t)
	h, calls := counted(c.handler(env))
	env.StartRunner(HandledBy(c.Subscriber, h), nil)
	ev, id := writeValid(env, c)
	waitCheckpointed(env, c.Subscriber.Name, id)
	env.WaitIdle(c.Subscriber.Name, 10*time.Second)
	env.Republish(id) // the same event id, stored a second time
	env.WaitIdle(c.Subscriber.Name, 10*time.Second)
	if n := calls.of(id); n != 1 {
		t.Errorf("handler called %d times for an event delivered twice under one id, want 1", n)
	}
	if n := c.Effects(env, ev, id); n != 1 {
		t.Errorf("effects = %d after a duplicate, want 1", n)
	}
}

// idempotentUnderRedelivery: an event redelivered after a crash between
// its commit and its ack is absorbed by the checkpoint.
func idempotentUnderRedelivery(t *testing.T, c Case) {
	t.Parallel()
	env := NewEnv(t)
	base := c.handler(env)
	// Let an instance consume whatever the handler's setup published,
	// so the next batch holds only the event under test.
	pre := env.StartRunner(HandledBy(c.Subscriber, base), nil)
	env.WaitIdle(c.Subscriber.Name, 10*time.Second)
	if err := pre.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}

	// The first instance records the effect and its checkpoint, then
	// dies before acking.
	recorded := make(chan struct{})
	var once sync.Once
	dying := env.NewRunner(HandledBy(c.Subscriber, base), nil)
	env.StartHooked(dying, testhooks.Subscriber{BeforeAck: func(ctx context.Context, _ []int64) {
		once.Do(func() { close(recorded) })
		<-ctx.Done()
	}})
	ev, id := writeValid(env, c)
	select {
	case <-recorded:
	case <-time.After(15 * time.Second):
		t.Fatal("event never handled")
	}
	stopCtx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_ = dying.Stop(stopCtx)

	// JetStream redelivers after the ack wait; the checkpoint absorbs it.
	h, calls := counted(base)
	env.StartRunner(HandledBy(c.Subscriber, h), nil)
	env.WaitIdle(c.Subscriber.Name, 15*time.Second)
	if n := c.Effects(env, ev, id); n != 1 {
		t.Errorf("effects = %d after a redelivery, want 1", n)
	}
	if n := calls.of(id); n != 0 {
		t.Errorf("handler ran %d times on a redelivered, checkpointed event, want 0", n)
	}

	pastTheCheckpoint(t, env, c, base, calls, ev, id)
}

// pastTheCheckpoint: an event handled once, redelivered after its
// checkpoint row is gone (say it was pruned), takes effect once still:
// the handler's own effect is idempotent (or, for a CheckpointOnly case,
// the suite sees its second effect), and an ordered subscriber's copy is
// refused as late.
func pastTheCheckpoint(t *testing.T, env *Env, c Case, base subscribers.Handler, calls *Calls, ev outbox.Event, id int64) {
	if err := bookkeeping.New(env.DB.Pool).CheckpointDelete(context.Background(), bookkeeping.CheckpointKeyParams{Subscriber: c.Subscriber.Name, EventID: id}); err != nil {
		t.Fatal(err)
	}
	env.Republish(id)
	if c.Subscriber.Ordered {
		// An ordered subscriber's event is also behind its aggregate's
		// checkpoint: the copy is refused as late, to the dead
		// letters, and the handler does not run.
		WaitFor(t, 10*time.Second, "the late copy in the dead letters", func() (bool, string) {
			for _, m := range env.DeadLetters(c.Subscriber.Name) {
				if m.Header.Get(wire.EventIDHeader) == strconv.FormatInt(id, 10) &&
					strings.Contains(m.Header.Get(subscribers.DeadReasonHeader), "moved past it") {
					return true, ""
				}
			}
			return false, "no dead letter for the copy"
		})
		if n := calls.of(id); n != 0 {
			t.Errorf("handler ran %d times on an event behind its aggregate's checkpoint, want 0", n)
		}
		if n := c.Effects(env, ev, id); n != 1 {
			t.Errorf("effects = %d after the late copy, want 1", n)
		}
		return
	}
	WaitFor(t, 10*time.Second, "the handler to run again", func() (bool, string) { return calls.of(id) == 1, "" })
	env.WaitIdle(c.Subscriber.Name, 10*time.Second)
	switch n := c.Effects(env, ev, id); {
	case c.CheckpointOnly && n != 2:
		t.Errorf("effects = %d after handling the event again without its checkpoint, want 2: the suite cannot see a second handling of this subscriber", n)
	case !c.CheckpointOnly && n != 1:
		t.Errorf("effects = %d after handling the event again, want 1 (the handler must be idempotent)", n)
	}
	if _, ok := base.TxHandler(); c.CheckpointOnly && !ok {
		t.Error("CheckpointOnly needs a TxHandler: only a checkpoint in the effect's own transaction makes it exactly once")
	}
}

// permanentErrorReachesDeadLettersWithReason: a permanent error sends the
// event to the dead letters with its reason, and the events behind it flow
// on.
func permanentErrorReachesDeadLettersWithReason(t *testing.T, c Case) {
	t.Parallel()
	env := NewEnv(t)
	h, _ := counted(c.handler(env))
	env.StartRunner(HandledBy(c.Subscriber, h), nil)
	var reason string
	bad := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		ev, r, err := c.Invalid(env, tx)
		reason = r
		return []outbox.Event{ev}, err
	})[0]
	// An event behind the bad one flows on. Whether it took effect
	// once is HandledOnceAndCheckpointed's to say: a case whose effect
	// is seen outside its transaction (the example's log line) may
	// show an attempt a loaded machine rolled back and redid.
	ev, id := writeValid(env, c)
	waitCheckpointed(env, c.Subscriber.Name, id)
	WaitFor(t, 15*time.Second, "the event's effect", func() (bool, string) {
		n := c.Effects(env, ev, id)
		return n >= 1, "effects " + itoa(int64(n))
	})
	WaitFor(t, 15*time.Second, "the dead letter", func() (bool, string) { return len(env.DeadLetters(c.Subscriber.Name)) > 0, "" })
	env.WaitIdle(c.Subscriber.Name, 15*time.Second)
	dead := env.DeadLetters(c.Subscriber.Name)
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	d := dead[0]
	if d.Header.Get(wire.EventIDHeader) != itoa(bad) || d.Header.Get(subscribers.DeadSubscriberHeader) != c.Subscriber.Name {
		t.Errorf("dead letter headers %v, want event %d of %s", d.Header, bad, c.Subscriber.Name)
	}
	if got := d.Header.Get(subscribers.DeadReasonHeader); !strings.Contains(got, reason) {
		t.Errorf("dead letter reason %q, want it to mention %q", got, reason)
	}
	if d.Header.Get(subscribers.DeadDeliveriesHeader) == "" || d.Header.Get(subscribers.DeadSubjectHeader) == "" {
		t.Errorf("dead letter lacks its delivery count or original subject: %v", d.Header)
	}
	if env.Checkpointed(c.Subscriber.Name, bad) {
		t.Errorf("dead-lettered event %d is in the checkpoint", bad)
	}
}

// cancelledContextStopsWork: a handler called with a cancelled context
// returns an error and takes no effect.
func cancelledContextStopsWork(t *testing.T, c Case) {
	t.Parallel()
	env := NewEnv(t)
	h := c.handler(env)
	var oev outbox.Event
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		var err error
		oev, err = c.Valid(env, tx)
		return nil, err // the business rows only: no runner would see it anyway
	})
	payload, err := encodePayload(oev)
	if err != nil {
		t.Fatal(err)
	}
	ev := subscribers.Event{ID: 1 << 40, Type: oev.Type, AggregateType: oev.AggregateType, AggregateID: oev.AggregateID,
		Payload: payload, CreatedAt: time.Now(), Delivery: 1}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if hh, ok := h.TxHandler(); ok {
		tx, err := env.DB.Pool.Begin(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		err = hh.HandleTx(ctx, tx, ev)
		_ = tx.Rollback(context.Background())
		if err == nil {
			t.Error("HandleTx with a cancelled context returned nil")
		}
	}
	if hh, ok := h.EventHandler(); ok {
		if err := hh.Handle(ctx, ev); err == nil {
			t.Error("Handle with a cancelled context returned nil")
		}
	}
	if n := c.Effects(env, oev, ev.ID); n != 0 {
		t.Errorf("effects = %d after a cancelled call, want 0", n)
	}
}

// handler builds the subscriber's handler on env's database.
func (c Case) handler(env *Env) subscribers.Handler {
	env.T.Helper()
	if c.Handler != nil {
		return c.Handler(env)
	}
	h, err := c.Subscriber.Build(subscribers.Deps{Context: context.Background(), Pool: env.DB.Pool, Logger: env.Logger})
	if err != nil {
		env.T.Fatal(err)
	}
	return h
}

func writeValid(env *Env, c Case) (outbox.Event, int64) {
	env.T.Helper()
	var ev outbox.Event
	id := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		var err error
		ev, err = c.Valid(env, tx)
		return []outbox.Event{ev}, err
	})[0]
	return ev, id
}

func waitCheckpointed(env *Env, name string, id int64) {
	env.T.Helper()
	WaitFor(env.T, 15*time.Second, "event "+itoa(id)+" in the checkpoint", func() (bool, string) {
		return env.Checkpointed(name, id), ""
	})
}
