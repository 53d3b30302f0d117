package wire_test

import (
	"encoding/json"
	"errors"
	"maps"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var events = stream.Config{Name: "EVENTS", SubjectPrefix: "events"}

// identity is a database with two epochs: rows from 100 on are epoch 2's.
func identity(t testing.TB) *outbox.Identity {
	t.Helper()
	ident, err := outbox.NewIdentity(outbox.Database{System: 7, Name: "shop"},
		[]outbox.Epoch{{N: 1, FirstID: 1}, {N: 2, FirstID: 100}})
	if err != nil {
		t.Fatal(err)
	}
	return ident
}

func claimed(id int64, eventType, aggregateID, headers, payload string, seq int64) outboxstore.Claimed {
	return outboxstore.Claimed{
		ID: id, EventType: eventType, AggregateType: "product", AggregateID: aggregateID,
		Headers: []byte(headers), Payload: []byte(payload),
		AggregateSeq: pgtype.Int8{Int64: seq, Valid: seq > 0},
		CreatedAt:    pgtype.Timestamptz{Time: time.Date(2026, 12, 7, 10, 0, 0, 123456789, time.UTC), Valid: true},
	}
}

// What Encode writes, Decode reads back: every field of the event, the
// writer's headers as stored, and the identity JetStream drops duplicates
// by.
func TestEncodeThenDecode(t *testing.T) {
	ident := identity(t)
	for _, c := range []struct {
		name string
		row  outboxstore.Claimed
	}{
		{"plain", claimed(42, "product.updated", "42", `{}`, `{"price_cents": 1999}`, 3)},
		{"writer headers", claimed(43, "order.created", "o-7", `{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`, `[1]`, 1)},
		{"unnumbered", claimed(44, "product.viewed", "9", `{}`, `null`, 0)},
		{"second epoch", claimed(150, "product.updated", "größe", `{"x-note": "a\tb"}`, `"s"`, 12)},
	} {
		t.Run(c.name, func(t *testing.T) {
			msg, err := wire.Encode(events, ident, c.row, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			if want := "events." + c.row.EventType; msg.Subject != want {
				t.Errorf("subject %q, want %q", msg.Subject, want)
			}
			origin := ident.OriginOf(c.row.ID)
			if got, want := msg.Header.Get(jetstream.MsgIDHeader), origin+":"+strconv.FormatInt(c.row.ID, 10); got != want {
				t.Errorf("Nats-Msg-Id %q, want %q", got, want)
			}
			if got := msg.Header.Get(jetstream.ExpectedStreamHeader); got != events.Name {
				t.Errorf("expected stream %q, want %q", got, events.Name)
			}
			ev, err := wire.Decode(msg.Data, msg.Header, msg.Subject, events.SubjectPrefix)
			if err != nil {
				t.Fatal(err)
			}
			want := wire.Event{ID: c.row.ID, Origin: origin, Type: c.row.EventType, AggregateType: c.row.AggregateType,
				AggregateID: c.row.AggregateID, AggregateSeq: c.row.AggregateSeq.Int64, CreatedAt: c.row.CreatedAt.Time,
				Payload: c.row.Payload, Headers: msg.Header, Subject: msg.Subject}
			if !sameEvent(ev, want) {
				t.Errorf("decoded %+v,\nwant    %+v", ev, want)
			}
			var writer map[string]string
			if string(c.row.Headers) != "{}" {
				writer = writerHeaders(t, c.row.Headers)
			}
			for k, v := range writer {
				if got := msg.Header.Values(k); len(got) != 1 || got[0] != v {
					t.Errorf("writer header %q arrived as %q, want %q", k, got, v)
				}
			}
		})
	}
}

// A row that breaks a writer rule can never be published: Encode says
// why, naming the rule, and nothing is sent.
func TestEncodeRefusesWhatCanNeverBePublished(t *testing.T) {
	ident := identity(t)
	for _, c := range []struct {
		name string
		row  outboxstore.Claimed
		want error
	}{
		{"subject with a space", claimed(1, "product updated", "1", `{}`, `{}`, 1), outbox.ErrInvalidEvent},
		{"headers not an object", claimed(1, "product.updated", "1", `[1]`, `{}`, 1), outbox.ErrInvalidEvent},
		{"header not a string", claimed(1, "product.updated", "1", `{"a": 1}`, `{}`, 1), outbox.ErrInvalidEvent},
		{"a header fanout sets", claimed(1, "product.updated", "1", `{"Fanout-Event-Id": "9"}`, `{}`, 1), outbox.ErrInvalidEvent},
		{"a header JetStream acts on", claimed(1, "product.updated", "1", `{"Nats-TTL": "1s"}`, `{}`, 1), outbox.ErrInvalidEvent},
		{"aggregate id with a newline", claimed(1, "product.updated", "1\r\n2", `{}`, `{}`, 1), outbox.ErrInvalidEvent},
		{"over max_payload", claimed(1, "product.updated", "1", `{}`, `"`+strings.Repeat("x", 2000)+`"`, 1), wire.ErrEventTooLarge},
	} {
		t.Run(c.name, func(t *testing.T) {
			msg, err := wire.Encode(events, ident, c.row, 1024)
			if !errors.Is(err, c.want) {
				t.Fatalf("Encode = %v, %v; want an error wrapping %v", msg, err, c.want)
			}
		})
	}
}

// A message that is not an outbox event (no id, a forged origin) is
// refused with the reason, whoever wrote it.
func TestDecodeRefusesWhatIsNoEvent(t *testing.T) {
	for _, h := range []nats.Header{
		{},
		{wire.EventIDHeader: {"x"}},
		{wire.EventIDHeader: {"-3"}},
		{wire.EventIDHeader: {"5"}, wire.OriginHeader: {"not an origin"}},
	} {
		if ev, err := wire.Decode(nil, h, "events.product.updated", "events"); err == nil {
			t.Errorf("Decode(%v) = %+v, want an error", h, ev)
		}
	}
}

// FuzzEncodeDecode: whatever a row holds, Encode never panics, and what
// it encodes decodes back to the row's event.
//
//	go test -run='^$' -fuzz=FuzzEncodeDecode -fuzztime=1m ./wire/
func FuzzEncodeDecode(f *testing.F) {
	f.Add(int64(42), "product.updated", "42", `{}`, `{"a":1}`, int64(3))
	f.Add(int64(150), "ünï.cöde", "größe", `{"traceparent":"x","X-Empty":""}`, `null`, int64(0))
	f.Add(int64(1), "a.>", "1", `{"Nats-Msg-Id":"1"}`, `1`, int64(1))
	ident := identity(f)
	f.Fuzz(func(t *testing.T, id int64, eventType, aggregateID, headers, payload string, seq int64) {
		if id <= 0 || seq < 0 {
			return // the schema's identity and numbering never give these
		}
		row := claimed(id, eventType, aggregateID, headers, payload, seq)
		msg, err := wire.Encode(events, ident, row, 1<<20)
		if err != nil {
			return
		}
		ev, err := wire.Decode(msg.Data, msg.Header, msg.Subject, events.SubjectPrefix)
		if err != nil {
			t.Fatalf("encoded row %d does not decode: %v", id, err)
		}
		want := wire.Event{ID: id, Origin: ident.OriginOf(id), Type: eventType, AggregateType: "product", AggregateID: aggregateID,
			AggregateSeq: seq, CreatedAt: row.CreatedAt.Time, Payload: row.Payload, Headers: msg.Header, Subject: msg.Subject}
		if !sameEvent(ev, want) {
			t.Fatalf("decoded %+v,\nwant    %+v", ev, want)
		}
	})
}

func sameEvent(a, b wire.Event) bool {
	return a.ID == b.ID && a.Origin == b.Origin && a.Type == b.Type && a.AggregateType == b.AggregateType &&
		a.AggregateID == b.AggregateID && a.AggregateSeq == b.AggregateSeq && a.CreatedAt.Equal(b.CreatedAt) &&
		string(a.Payload) == string(b.Payload) && a.Subject == b.Subject && maps.EqualFunc(a.Headers, b.Headers, func(x, y []string) bool {
		return strings.Join(x, "\x00") == strings.Join(y, "\x00")
	})
}

func writerHeaders(t *testing.T, raw []byte) map[string]string {
	t.Helper()
	var h map[string]string
	if err := json.Unmarshal(raw, &h); err != nil {
		t.Fatal(err)
	}
	return h
}
