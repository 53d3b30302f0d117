package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"
)

// fuzzMaxPayload is the fuzz server's max_payload: small, so that inputs of
// a few KiB reach it (the default, 1 MiB, is out of the fuzzer's reach).
const fuzzMaxPayload = 8 << 10

// FuzzPoisonRows inserts one outbox row per input by plain SQL, with the
// fuzzer's headers, event type, payload and aggregate id, and checks what
// must hold for any row the schema accepts:
//
//   - the row ends `sent` or `failed` within 15 s: never stuck, never
//     retried forever;
//   - a failed row's reason names it;
//   - a sent row is in the stream exactly once, under its Nats-Msg-Id, with
//     its subject, payload, aggregate id and every header as stored;
//   - the relay's connection is never dropped by the server.
//
// Inputs the schema refuses (a NUL or invalid UTF-8 in text, a \u0000 in
// jsonb) are skipped: that is Postgres speaking, not the relay. Each fuzz worker starts
// one database, one nats-server and one relay before f.Fuzz; plain `go test`
// runs the seeds on one of each in a second or two. To fuzz:
//
//	go test -run='^$' -fuzz=FuzzPoisonRows -fuzztime=5m ./relay/
func FuzzPoisonRows(f *testing.F) {
	for _, k := range poisonKinds {
		r := k.row.withDefaults()
		if r.createdAt != "now" {
			continue // created_at is not fuzzed
		}
		f.Add(r.headers, r.eventType, r.payload, r.aggregateID)
	}
	// Good rows, some at the limits.
	f.Add(`{}`, "product.updated", `{"product_id": 1}`, "1")
	f.Add(`{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "a=b"}`, "order.created", `[1, "two", null]`, "order-7")
	f.Add(`{"x-note": "größe\t42 ok", "X-Empty": ""}`, "ünïcödé.tÿpe", `"just a string"`, "größe")
	f.Add("{\"!#$%&'*+-.^_`|~09azAZ\": \"x\"}", strings.Repeat("a", outbox.MaxEventTypeLen), `null`, strings.Repeat("7", outbox.MaxAggregateLen))
	f.Add(`{}`, "product.updated", `{"blob": "`+strings.Repeat("x", fuzzMaxPayload-600)+`"}`, "1")
	f.Add(`{}`, "product.updated", `{"blob": "`+strings.Repeat("x", fuzzMaxPayload)+`"}`, "1")
	f.Add(`{}`, "product.updated", `{"s": "\\u0000"}`, "1")
	f.Add(`{}`, "product.updated", `{"s": "\u0000"}`, "1") // jsonb refuses it: skipped

	conf := filepath.Join(f.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, fmt.Appendf(nil, "max_payload: %d\n", fuzzMaxPayload), 0o600); err != nil {
		f.Fatal(err)
	}
	h := newHarness(f, natstest.WithArgs("-c", conf))
	nc := h.connect()
	r, err := New(Options{Relay: h.cfg.Relay, Stream: h.cfg.Stream, Pool: h.db.Pool, Conn: nc, Logger: testLogger(f)})
	if err != nil {
		f.Fatal(err)
	}
	h.start(r)
	js, err := jetstream.New(h.connect())
	if err != nil {
		f.Fatal(err)
	}
	ctx := context.Background()
	evs, err := js.Stream(ctx, h.cfg.Stream.Name)
	if err != nil {
		f.Fatal(err)
	}
	prefix := h.cfg.Stream.SubjectPrefix

	ident := h.identity()
	f.Fuzz(func(t *testing.T, headers, eventType, payload, aggregateID string) {
		// Most mutations of a JSON text are not JSON, and Postgres would
		// refuse them before the relay sees anything. So that the fuzzer's
		// bytes still reach the relay, a payload that is not JSON becomes a
		// JSON string, and headers that are not JSON become one header,
		// split at the first ':' into name and value.
		if !json.Valid([]byte(payload)) {
			b, _ := json.Marshal(payload)
			payload = string(b)
		}
		if !json.Valid([]byte(headers)) {
			name, value, _ := strings.Cut(headers, ":")
			b, _ := json.Marshal(map[string]string{name: value})
			headers = string(b)
		}
		// Each row is an aggregate of its own (the type is not fuzzed): a
		// failed row would hold the next row of its aggregate.
		aggregateType := "fuzz-" + strconv.FormatInt(rawAggregates.Add(1), 10)
		id, err := insertRaw(ctx, h.db.Pool, rawRow{aggregateType: aggregateType, aggregateID: aggregateID,
			eventType: eventType, payload: payload, headers: headers, createdAt: "now"})
		if err != nil {
			// Class 22 is data exceptions (invalid JSON or UTF-8, a NUL,
			// a number out of range); 54001 a JSON nested too deep.
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && (strings.HasPrefix(pgErr.Code, "22") || pgErr.Code == "54001") {
				t.Skipf("the schema refuses the row: %v", err)
			}
			t.Fatal(err)
		}
		r.Nudge()

		var status, reason string
		for deadline := time.Now().Add(15 * time.Second); ; {
			if err := h.db.Pool.QueryRow(ctx, `SELECT status, coalesce(last_error, '') FROM outbox WHERE id = $1`, id).Scan(&status, &reason); err != nil {
				t.Fatal(err)
			}
			if status == "sent" || status == "failed" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("row %d is still %s after 15s (last error %q)", id, status, reason)
			}
			time.Sleep(2 * time.Millisecond)
		}
		if n := nc.Stats().Reconnects; n != 0 || !nc.IsConnected() {
			t.Fatalf("the relay's connection was dropped (%d reconnects, status %v, last error %v)", n, nc.Status(), nc.LastError())
		}
		if status == "failed" {
			if !strings.Contains(reason, fmt.Sprintf("outbox row %d: ", id)) {
				t.Fatalf("row %d failed with %q, which does not name it", id, reason)
			}
			return
		}

		// Sent: the stream's last message is this row, and the stream holds
		// one message per sent row, so none is there twice.
		info, err := evs.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var sent uint64
		if err := h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status = 'sent'`).Scan(&sent); err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs != sent {
			t.Fatalf("stream holds %d messages for %d sent rows", info.State.Msgs, sent)
		}
		m, err := evs.GetMsg(ctx, info.State.LastSeq)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.Header.Get(wire.EventIDHeader); got != strconv.FormatInt(id, 10) {
			t.Fatalf("the last message is %s, want row %d", got, id)
		}
		var storedPayload, storedHeaders string
		if err := h.db.Pool.QueryRow(ctx, `SELECT payload::text, headers::text FROM outbox WHERE id = $1`, id).Scan(&storedPayload, &storedHeaders); err != nil {
			t.Fatal(err)
		}
		var want map[string]string
		if err := json.Unmarshal([]byte(storedHeaders), &want); err != nil || want == nil {
			t.Fatalf("row %d was sent with headers %s, which are not an object of strings: %v", id, storedHeaders, err)
		}
		want[wire.EventIDHeader] = strconv.FormatInt(id, 10)
		want[wire.EventTypeHeader] = eventType
		want[wire.AggregateTypeHeader] = aggregateType
		want[wire.AggregateSeqHeader] = "1" // the first event of its aggregate
		want[wire.AggregateIDHeader] = aggregateID
		want[jetstream.MsgIDHeader] = wire.MsgID(ident.OriginOf(id), id)
		want[wire.OriginHeader] = ident.OriginOf(id)
		want[jetstream.ExpectedStreamHeader] = h.cfg.Stream.Name
		want[wire.CreatedAtHeader] = m.Header.Get(wire.CreatedAtHeader) // a time; checked by TestRowsBecomeMessages
		for k, v := range want {
			if got := m.Header.Values(k); !slices.Equal(got, []string{v}) {
				t.Errorf("header %q arrived as %q, want %q", k, got, v)
			}
		}
		// A direct get (EVENTS allows them) adds where the message is.
		for _, k := range []string{jetstream.StreamHeader, jetstream.SequenceHeader, jetstream.SubjectHeader, jetstream.TimeStampHeaer} {
			m.Header.Del(k)
		}
		if len(m.Header) != len(want) {
			t.Errorf("message has headers %q, want exactly %q", m.Header, want)
		}
		if m.Subject != stream.Subject(prefix, eventType) || string(m.Data) != storedPayload {
			t.Errorf("message %q with body %.100q, want %q with %.100q", m.Subject, m.Data, stream.Subject(prefix, eventType), storedPayload)
		}
	})
}
