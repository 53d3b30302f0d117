package outbox_test

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/nats-io/nats.go/jetstream"
)

// A writer records the event in its own transaction. Committed, the relay
// publishes it to events.<type> with the event id as Nats-Msg-Id; rolled
// back, it never existed.
func Example() {
	ctx := context.Background()

	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	// ... UPDATE products SET price = 19.99 WHERE id = 42 ...
	id, err := outbox.Write(ctx, tx, outbox.Event{
		AggregateType: "product",
		AggregateID:   "42",
		Type:          "product.updated",
		Payload:       map[string]int{"product_id": 42, "price_cents": 1999},
	})
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}

	tx, err = pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	if _, err := outbox.Write(ctx, tx, outbox.Event{
		AggregateType: "product", AggregateID: "43", Type: "product.deleted",
		Payload: map[string]int{"product_id": 43},
	}); err != nil {
		panic(err)
	}
	_ = tx.Rollback(ctx) // the business change failed: no event

	// What a subscriber of events.> sees.
	consumer, err := js.OrderedConsumer(ctx, "EVENTS", jetstream.OrderedConsumerConfig{FilterSubjects: []string{"events.>"}})
	if err != nil {
		panic(err)
	}
	msg, err := consumer.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		panic(err)
	}
	fmt.Println(msg.Subject(), string(msg.Data()))
	fmt.Println("Nats-Msg-Id is the event id:", msg.Headers().Get("Nats-Msg-Id") == strconv.FormatInt(id, 10))

	stream, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		panic(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("events in the stream:", info.State.Msgs)
	// Output:
	// events.product.updated {"product_id": 42, "price_cents": 1999}
	// Nats-Msg-Id is the event id: true
	// events in the stream: 1
}
