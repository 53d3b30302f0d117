package subscribers_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
)

// An aggregate's first checkpoint row is made only by its first event, or
// by an event applied after a gap. An instance whose view of an aggregate
// is stale (the pin moved while the aggregate's first event was with
// another instance) and takes number 2 for the next is refused, out of
// turn, and the event is tried again: number 2 is never applied before
// number 1 as if in order.
func TestFirstCheckpointOnlyFromTheFirstEvent(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	r := env.NewRunner(fulfilment.Subscriber, nil)
	ctx := context.Background()
	advance := func(id int64, aggregate string, seq, prev int64, afterGap bool) error {
		return pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
			ev := subscribers.Event{ID: id, Type: "order.paid", AggregateType: "order", AggregateID: aggregate, AggregateSeq: seq}
			return subscribers.Advance(ctx, r, tx, ev, prev, afterGap)
		})
	}
	applied := func(aggregate string) int64 {
		key := bookkeeping.AggregateKey{Type: "order", ID: aggregate}
		states, err := bookkeeping.New(env.DB.Pool).AggregateList(ctx, bookkeeping.AggregateListParams{Subscriber: fulfilment.Name, Keys: []bookkeeping.AggregateKey{key}})
		if err != nil {
			t.Fatal(err)
		}
		return states[key].Last
	}

	// Order 1: number 2 arrives first, taken for the next.
	if err := advance(102, "1", 2, 1, false); err == nil || !strings.Contains(err.Error(), "the checkpoint is at number 0") {
		t.Fatalf("number 2 without number 1: want refused as out of turn, got %v", err)
	}
	if got := applied("1"); got != 0 {
		t.Fatalf("number 2 made the aggregate's first checkpoint row (at %d)", got)
	}
	for _, seq := range []int64{1, 2} {
		if err := advance(100+seq, "1", seq, seq-1, false); err != nil {
			t.Fatalf("number %d in turn: %v", seq, err)
		}
	}
	if got := applied("1"); got != 2 {
		t.Fatalf("checkpoint at %d after numbers 1 and 2, want 2", got)
	}

	// Order 2: number 3 after a gap given up on (or the first seen by a
	// consumer that began after the stream's start) starts the aggregate.
	if err := advance(203, "2", 3, 0, true); err != nil {
		t.Fatalf("number 3 after a gap: %v", err)
	}
	if got := applied("2"); got != 3 {
		t.Fatalf("checkpoint at %d after number 3 applied after a gap, want 3", got)
	}
}

// One batch may hold two databases' event 42: the checkpoint knows each by
// its key, so the one out of turn is refused even when the other moved
// its own aggregate.
func TestOrderedBatchKnowsEventsByTheirKeys(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	r := env.NewRunner(fulfilment.Subscriber, nil)
	ctx := context.Background()
	db, err := outbox.ReadDatabase(ctx, env.DB.Pool)
	if err != nil {
		t.Fatal(err)
	}
	other := anotherShop(t, env, db)
	ours := subscribers.Event{ID: 42, Type: "order.paid", AggregateType: "order", AggregateID: "7", AggregateSeq: 1}
	theirs := subscribers.Event{ID: 42, Origin: other, Type: "order.paid", AggregateType: "order", AggregateID: "7", AggregateSeq: 2}
	err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		return subscribers.AdvanceBatch(ctx, r, tx, []subscribers.Event{ours, theirs}, []int64{0, 1})
	})
	if err == nil || !strings.Contains(err.Error(), "the checkpoint is at number 0") {
		t.Fatalf("the other database's number 2 without its number 1, beside this one's event 42: want refused as out of turn, got %v", err)
	}
}

// An ordered subscriber refuses to start, at once and saying why, while
// the outbox does not number an event type it reads; numbered again, it
// starts.
func TestOrderedSubscriberRefusesUnnumberedEventTypes(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	store := outboxstore.New(env.DB.Pool)
	if err := store.SetNumbering(ctx, []string{"order.paid", "product.updated"}); err != nil {
		t.Fatal(err)
	}
	err := env.NewRunner(fulfilment.Subscriber, nil).Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "the outbox does not number order.paid, which it reads") {
		t.Fatalf("an ordered subscriber reading an unnumbered type started: %v", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the refusal waited for the start's deadline")
	}
	// Read through a pattern (thing.>) as well.
	if err := store.SetNumbering(ctx, []string{"product.updated", "thing.moved"}); err != nil {
		t.Fatal(err)
	}
	err = env.NewRunner((&orderedByDatabase{applied: map[string][]int64{}}).declared(), nil).Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "the outbox does not number thing.moved, which it reads") {
		t.Fatalf("an ordered subscriber reading an unnumbered type through thing.> started: %v", err)
	}

	if err := store.SetNumbering(ctx, []string{"product.updated"}); err != nil {
		t.Fatal(err)
	}
	// Running, it looks again every stream.check_interval: a type it reads
	// skipped since makes it not ready, saying why, until numbered again.
	r := env.NewRunner(fulfilment.Subscriber, func(o *subscribers.Options) { o.Stream.CheckInterval = 100 * time.Millisecond })
	env.Start(r)
	if err := r.Ready(); err != nil {
		t.Fatalf("started with every type it reads numbered, not ready: %v", err)
	}
	if err := store.SetNumbering(ctx, []string{"order.paid"}); err != nil {
		t.Fatal(err)
	}
	waitReady := func(want string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := r.Ready()
			if (want == "" && err == nil) || (want != "" && err != nil && strings.Contains(err.Error(), want)) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("readiness: %v, want %q", err, want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitReady("the outbox does not number order.paid, which it reads")
	if err := store.SetNumbering(ctx, nil); err != nil {
		t.Fatal(err)
	}
	waitReady("")
}
