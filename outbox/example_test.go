package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/wire"
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
	fmt.Println("Nats-Msg-Id is the event's origin and id:", msg.Headers().Get("Nats-Msg-Id") == msg.Headers().Get(wire.OriginHeader)+":"+strconv.FormatInt(id, 10))

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
	// Nats-Msg-Id is the event's origin and id: true
	// events in the stream: 1
}

// Headers must reach subscribers as written and must not change what
// JetStream does with the event: names starting with Nats- or Fanout- are
// reserved, and a value cannot hold a line break. The writer refuses such an
// event; the relay marks such a row, inserted by other means, failed.
func ExampleValidateHeaders() {
	for _, h := range []map[string]string{
		{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		{"Nats-TTL": "1s"},
		{"x-note": "two\nlines"},
	} {
		err := outbox.ValidateHeaders(h)
		fmt.Println(errors.Is(err, outbox.ErrInvalidEvent), err)
	}
	// Output:
	// false <nil>
	// true invalid outbox event: header name "Nats-TTL": the Nats- prefix is reserved for NATS and JetStream, which act on such headers
	// true invalid outbox event: header "x-note": value "two\nlines": control character '\n' at offset 3 (only tab is allowed: CR or LF would end the header line)
}
