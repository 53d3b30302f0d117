package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
)

// invalidEvents are events the relay would mark failed (see the relay's
// poison row tests, which insert the same kinds by plain SQL), plus those
// Postgres itself would refuse. want is what the error must mention.
var invalidEvents = []struct {
	name string
	e    outbox.Event
	want string
}{
	{"header name empty", withHeaders(map[string]string{"": "x"}), "empty header name"},
	{"header name with a colon", withHeaders(map[string]string{"a:b": "x"}), `header name "a:b"`},
	{"header name with a space", withHeaders(map[string]string{"trace parent": "x"}), `header name "trace parent"`},
	{"header name with a control character", withHeaders(map[string]string{"a\x01b": "x"}), `header name "a\x01b"`},
	{"header name with CRLF", withHeaders(map[string]string{"a\r\nNats-Rollup": "all"}), "header name"},
	{"header name with a separator", withHeaders(map[string]string{"a(b)": "x"}), `header name "a(b)"`},
	{"header name not ASCII", withHeaders(map[string]string{"spür": "x"}), "non-ASCII byte"},
	{"header value with CRLF", withHeaders(map[string]string{"x-note": "a\r\nNats-Rollup: all"}), `header "x-note"`},
	{"header value with LF", withHeaders(map[string]string{"x-note": "a\nb"}), `header "x-note"`},
	{"header value with NUL", withHeaders(map[string]string{"x-note": "a\x00b"}), `header "x-note"`},
	{"header value with DEL", withHeaders(map[string]string{"x-note": "a\x7fb"}), `header "x-note"`},
	{"header value with trailing space", withHeaders(map[string]string{"x-note": "a "}), "whitespace"},
	{"header value not UTF-8", withHeaders(map[string]string{"x-note": "a\xffb"}), "UTF-8"},
	{"headers over the size limit", withHeaders(map[string]string{"x-big": strings.Repeat("x", outbox.MaxHeadersSize)}), "headers are"},
	{"Nats-Expected-Last-Sequence", withHeaders(map[string]string{"Nats-Expected-Last-Sequence": "1"}), "Nats- prefix is reserved"},
	{"Nats-TTL", withHeaders(map[string]string{"Nats-TTL": "1s"}), "Nats- prefix is reserved"},
	{"Nats-Msg-Id", withHeaders(map[string]string{"Nats-Msg-Id": "42"}), "Nats- prefix is reserved"},
	{"nats-rollup lower case", withHeaders(map[string]string{"nats-rollup": "all"}), "Nats- prefix is reserved"},
	{"Fanout-Event-Id", withHeaders(map[string]string{wire.EventIDHeader: "1"}), "Fanout- prefix is reserved"},
	{"FANOUT-AGGREGATE-ID upper case", withHeaders(map[string]string{"FANOUT-AGGREGATE-ID": "1"}), "Fanout- prefix is reserved"},
	{"one bad header among good ones", withHeaders(map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "Nats-TTL": "1s"}), "Nats-TTL"},
	{"aggregate type with LF", event(func(e *outbox.Event) { e.AggregateType = "product\nNats-Rollup: all" }), "aggregate type"},
	{"aggregate id with CRLF", event(func(e *outbox.Event) { e.AggregateID = "1\r\n" }), "aggregate id"},
	{"aggregate id with leading space", event(func(e *outbox.Event) { e.AggregateID = " 1" }), "aggregate id"},
	{"aggregate id with NUL", event(func(e *outbox.Event) { e.AggregateID = "1\x00" }), "aggregate id"},
	{"aggregate id empty", event(func(e *outbox.Event) { e.AggregateID = "" }), "aggregate"},
	{"aggregate type empty", event(func(e *outbox.Event) { e.AggregateType = "" }), "aggregate"},
	{"aggregate id too long", event(func(e *outbox.Event) { e.AggregateID = strings.Repeat("7", outbox.MaxAggregateLen+1) }), "aggregate id"},
	{"event type with a space", event(func(e *outbox.Event) { e.Type = "product updated" }), "event type"},
	{"event type with a wildcard", event(func(e *outbox.Event) { e.Type = "product.*" }), "event type"},
	{"event type with an empty token", event(func(e *outbox.Event) { e.Type = "product..updated" }), "event type"},
	{"event type with CRLF", event(func(e *outbox.Event) { e.Type = "product.updated\r\nPUB x 1" }), "event type"},
	{"event type not UTF-8", event(func(e *outbox.Event) { e.Type = "product.\xff" }), "UTF-8"},
	{"event type too long", event(func(e *outbox.Event) { e.Type = "product." + strings.Repeat("u", outbox.MaxEventTypeLen) }), "event type"},
	{"event type empty", event(func(e *outbox.Event) { e.Type = "" }), "event type"},
	{"payload not JSON", event(func(e *outbox.Event) { e.Payload = []byte(`{not json`) }), "not valid JSON"},
	{"payload missing", event(func(e *outbox.Event) { e.Payload = nil }), "no payload"},
	{"payload with a NUL character", event(func(e *outbox.Event) { e.Payload = map[string]string{"name": "a\x00b"} }), `\u0000`},
	{"raw payload with a NUL escape", event(func(e *outbox.Event) { e.Payload = json.RawMessage(`{"name": "a\\\u0000"}`) }), `\u0000`},
}

func event(change func(*outbox.Event)) outbox.Event {
	e := outbox.Event{AggregateType: "product", AggregateID: "1", Type: "product.updated", Payload: map[string]int{"product_id": 1}}
	change(&e)
	return e
}

func withHeaders(h map[string]string) outbox.Event {
	return event(func(e *outbox.Event) { e.Headers = h })
}

// Write and Queue refuse every event the relay would mark failed, before
// anything reaches Postgres: the caller's transaction stays usable, and
// nothing is inserted.
func TestWriterRefusesInvalidEvents(t *testing.T) {
	ctx := context.Background()
	for _, tc := range invalidEvents {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx) //nolint:errcheck

			_, err = outbox.Write(ctx, tx, tc.e)
			if !errors.Is(err, outbox.ErrInvalidEvent) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Write: %v, want ErrInvalidEvent mentioning %q", err, tc.want)
			}
			b := &pgx.Batch{}
			err = outbox.Queue(b, tc.e, nil)
			if !errors.Is(err, outbox.ErrInvalidEvent) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Queue: %v, want ErrInvalidEvent mentioning %q", err, tc.want)
			}
			if b.Len() != 0 {
				t.Errorf("Queue queued %d statements for a refused event", b.Len())
			}
			if err != nil && len(err.Error()) > 500 {
				t.Errorf("the error is %d bytes long; it should describe the value, not repeat it", len(err.Error()))
			}

			// The transaction is intact: a good event still goes in.
			if _, err := outbox.Write(ctx, tx, event(func(*outbox.Event) {})); err != nil {
				t.Fatalf("Write of a good event after the refusal: %v", err)
			}
		})
	}
}

// The limits are inclusive, and what they admit, Postgres stores.
func TestWriterAcceptsEventsAtTheLimits(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		e    outbox.Event
	}{
		{"event type of MaxEventTypeLen bytes", event(func(e *outbox.Event) {
			e.Type = "product." + strings.Repeat("u", outbox.MaxEventTypeLen-len("product."))
		})},
		{"aggregate id of MaxAggregateLen bytes", event(func(e *outbox.Event) { e.AggregateID = strings.Repeat("7", outbox.MaxAggregateLen) })},
		{"headers of MaxHeadersSize bytes", withHeaders(map[string]string{"x-big": strings.Repeat("x", outbox.MaxHeadersSize-len("x-big: \r\n"))})},
		{"header value with inner spaces, tabs and UTF-8", withHeaders(map[string]string{"x-note": "größe\t42 ok"})},
		{"header names with every token character", withHeaders(map[string]string{"!#$%&'*+-.^_`|~09azAZ": "x", "Natsy": "x", "X-Nats-Foo": "x"})},
		{"empty header value", withHeaders(map[string]string{"x-empty": ""})},
		{"payload with an escaped backslash before u0000", event(func(e *outbox.Event) { e.Payload = json.RawMessage(`{"path": "C:\\u0000"}`) })},
		{"aggregate id with UTF-8", event(func(e *outbox.Event) { e.AggregateID = "größe-42" })},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// Rolled back: the package's examples count the stream's events.
			defer tx.Rollback(ctx) //nolint:errcheck
			if _, err := outbox.Write(ctx, tx, tc.e); err != nil {
				t.Fatalf("Write: %v", err)
			}
		})
	}
}
