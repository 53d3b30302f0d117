package relay

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// rawRow is an outbox row as a writer in another language, or a person at a
// psql prompt, may insert it: any value the schema allows. Empty fields take
// the values of a good row.
type rawRow struct {
	aggregateType, aggregateID, eventType, payload, headers string
	createdAt                                               string // a timestamptz literal; empty is now()
	emptyAggregateID                                        bool   // aggregateID is '' on purpose
}

// rawAggregates numbers the aggregates of raw rows.
var rawAggregates atomic.Int64

func (r rawRow) withDefaults() rawRow {
	def := func(s *string, d string) {
		if *s == "" {
			*s = d
		}
	}
	def(&r.aggregateType, "product")
	if !r.emptyAggregateID {
		// An aggregate of its own: a failed row holds its aggregate's
		// later events (TestFailedEventHoldsItsAggregate), and these tests
		// are about the rows of other aggregates behind it.
		def(&r.aggregateID, "raw-"+strconv.FormatInt(rawAggregates.Add(1), 10))
	}
	def(&r.eventType, "product.updated")
	def(&r.payload, `{"product_id": 1}`)
	def(&r.headers, `{}`)
	def(&r.createdAt, "now")
	return r
}

// insertRaw inserts r as it is (see withDefaults) by plain SQL, behind the
// writer API's back. The values go in as text and Postgres parses them, as it
// would literals.
func insertRaw(ctx context.Context, pool *pgxpool.Pool, r rawRow) (int64, error) {
	var id int64
	err := pool.QueryRow(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, created_at)
VALUES ($1, $2, $3, $4::text::jsonb, $5::text::jsonb, $6::text::timestamptz)
RETURNING id`, r.aggregateType, r.aggregateID, r.eventType, r.payload, r.headers, r.createdAt).Scan(&id)
	return id, err
}

// poisonKinds are rows the schema accepts and NATS can never carry as they
// are. want is what the reason must mention, besides the row id.
var poisonKinds = []struct {
	name string
	row  rawRow
	want string
}{
	// Headers that are not a JSON object of strings.
	{"header value a number", rawRow{headers: `{"retry": 1}`}, `header "retry"`},
	{"header value an array", rawRow{headers: `{"tags": ["a", "b"]}`}, `header "tags"`},
	{"header value null", rawRow{headers: `{"traceparent": null}`}, `header "traceparent"`},
	{"header value an object", rawRow{headers: `{"trace": {"id": "x"}}`}, `header "trace"`},
	{"header value a boolean", rawRow{headers: `{"sampled": true}`}, `header "sampled"`},
	{"headers null", rawRow{headers: `null`}, "JSON object"},
	{"headers an array", rawRow{headers: `[["traceparent", "x"]]`}, "JSON object"},
	{"headers an empty array", rawRow{headers: `[]`}, "JSON object"},
	{"headers a string", rawRow{headers: `"traceparent"`}, "JSON object"},
	{"headers a number", rawRow{headers: `7`}, "JSON object"},
	// Header names NATS cannot carry: RFC 7230 tokens only.
	{"header name empty", rawRow{headers: `{"": "x"}`}, "empty header name"},
	{"header name with a colon", rawRow{headers: `{"a:b": "x"}`}, `header name "a:b"`},
	{"header name with a space", rawRow{headers: `{"trace parent": "x"}`}, `header name "trace parent"`},
	{"header name with a control character", rawRow{headers: `{"a\u0001b": "x"}`}, `header name "a\x01b"`},
	{"header name with CRLF", rawRow{headers: `{"a\r\nNats-Rollup": "all"}`}, `header name "a\r\nNats-Rollup"`},
	{"header name with a separator", rawRow{headers: `{"a(b)": "x"}`}, `header name "a(b)"`},
	{"header name not ASCII", rawRow{headers: `{"spür": "x"}`}, `header name "spür"`},
	// Header values that would break or be changed by the wire format.
	{"header value with CRLF", rawRow{headers: `{"x-note": "a\r\nNats-Rollup: all"}`}, `header "x-note"`},
	{"header value with LF", rawRow{headers: `{"x-note": "a\nb"}`}, `header "x-note"`},
	{"header value with a control character", rawRow{headers: `{"x-note": "a\u0007b"}`}, `header "x-note"`},
	{"header value with DEL", rawRow{headers: `{"x-note": "a\u007fb"}`}, `header "x-note"`},
	{"header value with leading space", rawRow{headers: `{"x-note": " a"}`}, `header "x-note"`},
	{"headers over the size limit", rawRow{headers: `{"x-big": "` + strings.Repeat("x", 70000) + `"}`}, "headers are"},
	// Reserved names: JetStream acts on Nats-*, subscribers trust Fanout-*.
	{"Nats-Expected-Last-Sequence", rawRow{headers: `{"Nats-Expected-Last-Sequence": "1"}`}, "Nats- prefix is reserved"},
	{"Nats-TTL", rawRow{headers: `{"Nats-TTL": "1s"}`}, "Nats- prefix is reserved"},
	{"Nats-Msg-Id", rawRow{headers: `{"Nats-Msg-Id": "42"}`}, "Nats- prefix is reserved"},
	{"nats-msg-id lower case", rawRow{headers: `{"nats-msg-id": "42"}`}, "Nats- prefix is reserved"},
	{"Nats-Rollup", rawRow{headers: `{"Nats-Rollup": "all"}`}, "Nats- prefix is reserved"},
	{"Nats-Expected-Stream", rawRow{headers: `{"Nats-Expected-Stream": "OTHER"}`}, "Nats- prefix is reserved"},
	{"Nats-Trace-Dest", rawRow{headers: `{"Nats-Trace-Dest": "trace"}`}, "Nats- prefix is reserved"},
	{"Fanout-Event-Id", rawRow{headers: `{"Fanout-Event-Id": "1"}`}, "Fanout- prefix is reserved"},
	{"fanout-event-type lower case", rawRow{headers: `{"fanout-event-type": "x"}`}, "Fanout- prefix is reserved"},
	{"Fanout-Dead-Reason", rawRow{headers: `{"Fanout-Dead-Reason": "x"}`}, "Fanout- prefix is reserved"},
	// Aggregate type and id travel as header values.
	{"aggregate type with LF", rawRow{aggregateType: "product\nNats-Rollup: all"}, "aggregate type"},
	{"aggregate id with CRLF", rawRow{aggregateID: "1\r\n"}, "aggregate id"},
	{"aggregate id with a tab at the end", rawRow{aggregateID: "1\t"}, "aggregate id"},
	{"aggregate id empty", rawRow{emptyAggregateID: true}, "aggregate"},
	{"aggregate id too long", rawRow{aggregateID: strings.Repeat("7", 70000)}, "aggregate id"},
	// Event types that cannot be a subject.
	{"event type with a space", rawRow{eventType: "product updated"}, "event type"},
	{"event type with a wildcard", rawRow{eventType: "product.>"}, "event type"},
	{"event type with an empty token", rawRow{eventType: "product..updated"}, "event type"},
	{"event type with CRLF", rawRow{eventType: "product.updated\r\nPUB x 1"}, "event type"},
	// Longer than max_control_line (4096): the server would close the connection.
	{"event type of 5000 bytes", rawRow{eventType: strings.Repeat("e", 5000)}, "event type"},
	{"event type of 256 bytes", rawRow{eventType: "product." + strings.Repeat("u", 248)}, "event type"},
	// A payload over the server's max_payload (1 MiB by default).
	{"payload too large", rawRow{payload: `{"blob": "` + strings.Repeat("x", 1100000) + `"}`}, "max_payload"},
	// A creation time that is no point in time.
	{"created_at infinity", rawRow{createdAt: "infinity"}, "created_at"},
	{"created_at -infinity", rawRow{createdAt: "-infinity"}, "created_at"},
}

// The reported bug: a number in headers made the whole claim fail to
// decode, so that row and every row behind it stayed `sending` forever
// (claimed, reaped, claimed again).
func TestHeadersNotAllStringsDoNotBlockTheBatch(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	var good []int64
	for i := range 3 {
		id, err := insertRaw(ctx, h.db.Pool, rawRow{}.withDefaults())
		if err != nil {
			t.Fatal(err)
		}
		good = append(good, id)
		if i == 0 {
			bad, err := insertRaw(ctx, h.db.Pool, rawRow{headers: `{"retry": 1}`}.withDefaults())
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				var reason string
				if err := h.db.Pool.QueryRow(ctx, `SELECT coalesce(last_error, '') FROM outbox WHERE id = $1`, bad).Scan(&reason); err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(reason, fmt.Sprintf("outbox row %d", bad)) || !strings.Contains(reason, `header "retry"`) {
					t.Errorf("row %d failed with %q, want its id and the header named", bad, reason)
				}
			}()
		}
	}
	h.startRelay(nil, nil)
	waitFor(t, 15*time.Second, "3 sent and 1 failed", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return c["sent"] == 3 && c["failed"] == 1, formatCounts(c)
	})
	if got := len(h.streamMessages()); got != len(good) {
		t.Errorf("stream holds %d messages, want the %d good rows", got, len(good))
	}
}

// Every kind of poison row, interleaved with good rows in one batch: each
// poison row fails with a reason naming it and its problem, every good row is
// published, and the relay's connection survives.
func TestPoisonRowsOfEveryKind(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		good := map[int64]bool{}
		poison := map[int64]int{} // id -> index in poisonKinds
		addGood := func() {
			id, err := insertRaw(ctx, h.db.Pool, rawRow{aggregateID: strconv.Itoa(len(good))}.withDefaults())
			if err != nil {
				t.Fatal(err)
			}
			good[id] = true
		}
		nc := h.connect()
		r, err := New(Options{Relay: h.cfg.Relay, Stream: h.cfg.Stream, Pool: h.db.Pool, Conn: nc, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		if h.wal() {
			r.cfg.Slot = h.db.Name
		}
		h.launch(r, func() {
			for i, k := range poisonKinds {
				addGood()
				id, err := insertRaw(ctx, h.db.Pool, k.row.withDefaults())
				if err != nil {
					t.Fatalf("%s: insert: %v", k.name, err)
				}
				poison[id] = i
			}
			addGood()
		})
		// In wal capture the relay marks only the rows it fails.
		published, goodStatus := func() int { return statusCounts(t, h.db.Pool)["sent"] }, "sent"
		if h.wal() {
			published, goodStatus = h.streamCount, "pending"
		}
		want := fmt.Sprintf("%d published and %d failed", len(good), len(poison))
		waitFor(t, 20*time.Second, want, func() (bool, string) {
			c := statusCounts(t, h.db.Pool)
			if nc.IsClosed() {
				t.Fatalf("the relay's connection is closed: %v (%s)", nc.LastError(), formatCounts(c))
			}
			return published() == len(good) && c["failed"] == len(poison), formatCounts(c) + fmt.Sprintf(" published=%d", published())
		})
		if c := statusCounts(t, h.db.Pool); !h.wal() && c["pending"]+c["sending"] != 0 {
			t.Errorf("rows left waiting: %s", formatCounts(c))
		}
		if n := nc.Stats().Reconnects; n != 0 || !nc.IsConnected() {
			t.Errorf("the relay's connection reconnected %d times (connected: %t, last error %v): a row made the server drop it",
				n, nc.IsConnected(), nc.LastError())
		}

		rows, err := h.db.Pool.Query(ctx, `SELECT id, status, coalesce(last_error, ''), attempts FROM outbox ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var id int64
			var status, reason string
			var attempts int
			if err := rows.Scan(&id, &status, &reason, &attempts); err != nil {
				t.Fatal(err)
			}
			i, isPoison := poison[id]
			if !isPoison {
				if status != goodStatus {
					t.Errorf("good row %d is %s (%s), want %s", id, status, reason, goodStatus)
				}
				continue
			}
			k := poisonKinds[i]
			t.Logf("%s: %s", k.name, reason)
			if status != "failed" || attempts != 1 {
				t.Errorf("%s: row %d is %s after %d attempts (%s), want failed at the first", k.name, id, status, attempts, reason)
				continue
			}
			if !strings.Contains(reason, fmt.Sprintf("outbox row %d:", id)) || !strings.Contains(reason, k.want) {
				t.Errorf("%s: row %d failed with %q, want its id and %q", k.name, id, reason, k.want)
			}
			if len(reason) > 1000 {
				t.Errorf("%s: reason is %d bytes long; it should describe the value, not repeat it", k.name, len(reason))
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}

		msgs := h.streamMessages()
		for _, m := range msgs {
			id, _ := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
			if !good[id] {
				t.Errorf("stream holds message %d (subject %.60q), not a good row", id, m.Subject)
			}
		}
		if len(msgs) != len(good) {
			t.Errorf("stream holds %d messages, want the %d good rows", len(msgs), len(good))
		}
	})
}

// The relay's size check is exact: an event of exactly max_payload bytes
// (headers and body, as nats.go encodes them) is published, one byte more
// fails. An estimate too low would leave it to nats.go to refuse the
// publish; one too high would fail events the server accepts.
func TestEventOfExactlyMaxPayload(t *testing.T) {
	t.Parallel()
	const maxPayload = 4096
	conf := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, fmt.Appendf(nil, "max_payload: %d\n", maxPayload), 0o600); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, natstest.WithArgs("-c", conf))
	ctx := context.Background()

	// Both rows have one-digit ids and the same created_at, so their
	// headers are as long as those of this row.
	const createdAt = "2026-01-01T00:00:00.123456Z"
	at, err := time.Parse(time.RFC3339Nano, createdAt)
	if err != nil {
		t.Fatal(err)
	}
	r := h.newRelay(nil, nil)
	probe, err := r.publisher.message(row{ID: 1, AggregateType: "product", AggregateID: "1", EventType: "product.updated",
		Payload: []byte(`""`), Headers: []byte(`{}`), CreatedAt: pgtype.Timestamptz{Time: at, Valid: true},
		AggregateSeq: pgtype.Int8{Int64: 1, Valid: true}}, 0)
	if err != nil {
		t.Fatal(err)
	}
	headerBytes := probe.Size() - len(probe.Subject) - len(probe.Data)
	body := func(n int) string { return `"` + strings.Repeat("x", n-2) + `"` } // a JSON string of n bytes, as jsonb prints it

	// Two aggregates with one-digit ids, each row the first of its own.
	fits, err := insertRaw(ctx, h.db.Pool, rawRow{aggregateID: "1", payload: body(maxPayload - headerBytes), createdAt: createdAt}.withDefaults())
	if err != nil {
		t.Fatal(err)
	}
	over, err := insertRaw(ctx, h.db.Pool, rawRow{aggregateID: "2", payload: body(maxPayload - headerBytes + 1), createdAt: createdAt}.withDefaults())
	if err != nil {
		t.Fatal(err)
	}
	if fits > 9 || over > 9 {
		t.Fatalf("ids %d and %d: the sizes assume one-digit ids", fits, over)
	}
	h.start(r)
	waitFor(t, 15*time.Second, "1 sent and 1 failed", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return c["sent"] == 1 && c["failed"] == 1, formatCounts(c)
	})
	var status, reason string
	if err := h.db.Pool.QueryRow(ctx, `SELECT status, coalesce(last_error, '') FROM outbox WHERE id = $1`, over).Scan(&status, &reason); err != nil {
		t.Fatal(err)
	}
	if status != "failed" || !strings.Contains(reason, fmt.Sprintf("event is %d bytes with headers, over the server's max_payload of %d", maxPayload+1, maxPayload)) {
		t.Errorf("the row one byte over max_payload is %s: %q", status, reason)
	}
	msgs := h.streamMessages()
	if len(msgs) != 1 || msgs[0].Header.Get(wire.EventIDHeader) != strconv.FormatInt(fits, 10) {
		t.Fatalf("stream holds %d messages, want only row %d", len(msgs), fits)
	}
	if got := len(msgs[0].Data) + headerBytes; got != maxPayload {
		t.Errorf("the published event is %d bytes, want exactly max_payload (%d)", got, maxPayload)
	}
}
