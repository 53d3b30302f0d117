package searchindex_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// The replay reads every event once, even when the server loses
// its consumer mid-replay (with stream.provision auto it makes it again),
// and when the consumer is moved behind its back (its sequence restarts:
// a gap the reader must notice). The consumer stays, as provisioned.
func TestReadEventsSurvivesALostOrMovedConsumer(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx := context.Background()
	var evs []outbox.Event
	for i := range 1200 {
		evs = append(evs, outbox.Event{AggregateType: "product", AggregateID: strconv.Itoa(i), Type: "product.updated",
			Payload: map[string]int{"product_id": i}})
	}
	ids := env.Write(func(pgx.Tx) ([]outbox.Event, error) { return evs, nil })
	env.WaitSent(ids...)
	events, err := env.JS.Stream(ctx, env.Config.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	last := events.CachedInfo().State.LastSeq

	var got []int64
	calls := 0
	read, pos, err := searchindex.ReadEvents(ctx, env.JS, env.Config.Stream, 0, last, func(batch []subscribers.Event) error {
		calls++
		for _, ev := range batch {
			got = append(got, ev.ID)
		}
		switch calls {
		case 1: // lost: deleted as inactive, or with its node
			if err := events.DeleteConsumer(ctx, stream.ReindexConsumer); err != nil {
				t.Fatal(err)
			}
		case 2: // moved further on
			if _, err := events.ResetConsumerToSequence(ctx, stream.ReindexConsumer, last-10); err != nil {
				t.Fatal(err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Stream order is the relay's publish order, not id order: compare
	// the sets, duplicates included.
	slices.Sort(got)
	slices.Sort(ids)
	if calls < 3 || read != len(ids) || pos != last || !slices.Equal(got, ids) {
		t.Errorf("replay: %d calls, read %d events up to seq %d; want each of the %d events once, up to %d (got %d events, %d distinct)",
			calls, read, pos, len(ids), last, len(got), len(slices.Compact(slices.Clone(got))))
	}
	c, err := events.Consumer(ctx, stream.ReindexConsumer)
	if err != nil {
		t.Fatalf("the replay consumer after the replay: %v", err)
	}
	if ds := stream.ReaderDifferences(c.CachedInfo().Config, searchindex.ReplayConsumerConfig(env.Config.Stream)); len(ds) > 0 {
		t.Errorf("the replay consumer after the replay: %s", stream.Join(ds))
	}
}

// Without provisioning (stream.provision verify or off, the production
// layout) a replay makes no consumer, and reads through none that differs
// from its configuration: one pushing events into a subscriber's
// CONSUMER.RESET would move that subscriber's position.
func TestReadEventsRefusesAConsumerItDidNotProvision(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx := context.Background()
	ids := env.Write(func(pgx.Tx) ([]outbox.Event, error) {
		return []outbox.Event{{AggregateType: "product", AggregateID: "1", Type: "product.updated", Payload: map[string]int{"product_id": 1}}}, nil
	})
	env.WaitSent(ids...)
	events, err := env.JS.Stream(ctx, env.Config.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	verify := env.Config.Stream
	verify.Provision = "verify"
	read := func() error {
		_, _, err := searchindex.ReadEvents(ctx, env.JS, verify, 0, events.CachedInfo().State.LastSeq, func([]subscribers.Event) error { return nil })
		return err
	}
	if err := read(); err == nil || !strings.Contains(err.Error(), "does not exist") || !strings.Contains(err.Error(), "fanout provision") {
		t.Errorf("a replay without its consumer: %v, want a refusal naming fanout provision", err)
	}
	if _, err := events.Consumer(ctx, stream.ReindexConsumer); !errors.Is(err, jetstream.ErrConsumerNotFound) {
		t.Errorf("the replay made its consumer with stream.provision verify: %v", err)
	}
	push := searchindex.ReplayConsumerConfig(env.Config.Stream)
	push.DeliverSubject = "$JS.API.CONSUMER.RESET." + env.Config.Stream.Name + ".invoicing"
	if _, err := events.CreateConsumer(ctx, push); err != nil {
		t.Fatal(err)
	}
	err = read()
	if !errors.Is(err, stream.ErrReaderDiffers) || !strings.Contains(err.Error(), "deliver_subject") || !strings.Contains(err.Error(), stream.ReindexConsumer) {
		t.Errorf("a replay through a push consumer: %v, want a refusal naming the consumer and its deliver_subject", err)
	}
	if err := events.DeleteConsumer(ctx, stream.ReindexConsumer); err != nil {
		t.Fatal(err)
	}
	if _, err := events.CreateConsumer(ctx, searchindex.ReplayConsumerConfig(env.Config.Stream)); err != nil {
		t.Fatal(err)
	}
	if err := read(); err != nil {
		t.Errorf("a replay through its provisioned consumer: %v", err)
	}
}

// A reindex replays every event type the indexer handles, category renames
// included (a replay without them would swap in an index with old category
// names), and nothing else.
func TestReadEventsReadsWhatTheIndexerHandles(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx := context.Background()
	types := []string{shop.ProductUpdated, shop.BrandUpdated, shop.CategoryUpdated, shop.OrderCreated}
	var evs []outbox.Event
	for i, ty := range types {
		evs = append(evs, outbox.Event{AggregateType: strings.SplitN(ty, ".", 2)[0], AggregateID: strconv.Itoa(i + 1), Type: ty,
			Payload: map[string]int{"product_id": i + 1, "brand_id": i + 1, "category_id": i + 1, "order_id": i + 1}})
	}
	ids := env.Write(func(pgx.Tx) ([]outbox.Event, error) { return evs, nil })
	env.WaitSent(ids...)
	events, err := env.JS.Stream(ctx, env.Config.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	_, _, err = searchindex.ReadEvents(ctx, env.JS, env.Config.Stream, 0, events.CachedInfo().State.LastSeq, func(batch []subscribers.Event) error {
		for _, ev := range batch {
			got = append(got, ev.Type)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	if want := []string{shop.BrandUpdated, shop.CategoryUpdated, shop.ProductUpdated}; !slices.Equal(got, want) {
		t.Errorf("replay read %v, want %v", got, want)
	}
}
