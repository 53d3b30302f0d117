package relay

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

func TestRowsBecomeMessages(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.startRelay(nil, nil)
	ctx := context.Background()

	trace := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ids := write(t, h.db.Pool,
		outbox.Event{AggregateType: "product", AggregateID: "7", Type: "product.updated",
			Payload: json.RawMessage(`{"product_id": 7, "price_cents": 1999}`), Headers: map[string]string{"traceparent": trace}},
		outbox.Event{AggregateType: "order", AggregateID: "3", Type: "order.created",
			Payload: map[string]any{"order_id": 3}},
	)
	// A rolled-back transaction publishes nothing.
	tx, err := h.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.Write(ctx, tx, productEvent(99)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	h.waitAllSent(2, 10*time.Second)
	msgs := h.streamMessages()
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d messages, want 2 (the rolled-back event must not be published)", len(msgs))
	}
	byID := map[string]int{}
	for i, m := range msgs {
		byID[m.Header.Get(wire.EventIDHeader)] = i
	}
	first := msgs[byID[strconv.FormatInt(ids[0], 10)]]
	if first.Subject != "events.product.updated" {
		t.Errorf("subject = %q, want events.product.updated", first.Subject)
	}
	var body map[string]int
	if err := json.Unmarshal(first.Data, &body); err != nil || body["product_id"] != 7 || body["price_cents"] != 1999 {
		t.Errorf("body = %s, want the payload as stored", first.Data)
	}
	for header, want := range map[string]string{
		"Nats-Msg-Id":            h.identity().OriginOf(ids[0]) + ":" + strconv.FormatInt(ids[0], 10),
		wire.OriginHeader:        h.identity().OriginOf(ids[0]),
		wire.EventIDHeader:       strconv.FormatInt(ids[0], 10),
		wire.EventTypeHeader:     "product.updated",
		wire.AggregateTypeHeader: "product",
		wire.AggregateIDHeader:   "7",
		"traceparent":            trace,
	} {
		if got := first.Header.Get(header); got != want {
			t.Errorf("header %s = %q, want %q", header, got, want)
		}
	}
	created, err := time.Parse(time.RFC3339Nano, first.Header.Get(wire.CreatedAtHeader))
	if err != nil || time.Since(created) > time.Minute || time.Since(created) < 0 {
		t.Errorf("header %s = %q, want the row's creation time", wire.CreatedAtHeader, first.Header.Get(wire.CreatedAtHeader))
	}
	second := msgs[byID[strconv.FormatInt(ids[1], 10)]]
	if second.Subject != "events.order.created" || second.Header.Get(wire.AggregateIDHeader) != "3" {
		t.Errorf("second message: subject %q aggregate id %q", second.Subject, second.Header.Get(wire.AggregateIDHeader))
	}

	var published time.Time
	if err := h.db.Pool.QueryRow(ctx, `SELECT published_at FROM outbox WHERE id = $1`, ids[0]).Scan(&published); err != nil || published.IsZero() {
		t.Errorf("published_at not set: %v", err)
	}
}

func TestWriteRefusesEventsThatCanNeverBePublished(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	for _, e := range []outbox.Event{
		{AggregateType: "p", AggregateID: "1", Type: "product updated", Payload: map[string]int{}},
		{AggregateType: "p", AggregateID: "1", Type: "product.*", Payload: map[string]int{}},
		{AggregateType: "p", AggregateID: "1", Type: "product..updated", Payload: map[string]int{}},
		{AggregateType: "p", AggregateID: "1", Type: "product.updated", Payload: []byte(`{not json`)},
		{AggregateType: "", AggregateID: "1", Type: "product.updated", Payload: map[string]int{}},
	} {
		err := pgx.BeginFunc(ctx, h.db.Pool, func(tx pgx.Tx) error {
			_, err := outbox.Write(ctx, tx, e)
			return err
		})
		if !errors.Is(err, outbox.ErrInvalidEvent) {
			t.Errorf("Write(%q, payload %v) = %v, want ErrInvalidEvent", e.Type, e.Payload, err)
		}
	}
	if c := statusCounts(t, h.db.Pool); len(c) != 0 {
		t.Errorf("outbox rows after refused writes: %v", c)
	}
}

func TestTwoRelaysStoreEveryRowOnce(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		small := func(c *Config) { c.BatchSize = 50; c.MaxInFlight = 200 }
		a, b := &recorder{}, &recorder{}
		ra := h.startRelay(small, a)
		rb := h.startRelay(small, b)
		if h.wal() {
			// One streams from the slot, the other stands by.
			waitFor(t, 20*time.Second, "one relay streaming, one standing by", func() (bool, string) {
				sa, sb := ra.wal.state.Load(), rb.wal.state.Load()
				return sa+sb == captureStreaming+captureStandby && sa != sb, fmt.Sprintf("states %d and %d", sa, sb)
			})
		}

		const n = 3000
		writeMany(t, h.db.Pool, n)
		h.waitAllSent(n, 60*time.Second)

		msgs := h.streamMessages()
		seen := map[string]bool{}
		for _, m := range msgs {
			id := m.Header.Get(wire.EventIDHeader)
			if seen[id] {
				t.Fatalf("event %s stored twice", id)
			}
			seen[id] = true
		}
		if len(msgs) != n {
			t.Fatalf("stream holds %d messages, want %d", len(msgs), n)
		}
		// The relays tell their observers after the record commits: the
		// last batch's word may come just after the rows read as sent.
		var pa, pb []Published
		waitFor(t, 20*time.Second, "the relays' observers told of every row", func() (bool, string) {
			pa, _ = a.snapshot()
			pb, _ = b.snapshot()
			return len(pa)+len(pb) >= n, fmt.Sprintf("%d+%d", len(pa), len(pb))
		})
		t.Logf("relay a published %d rows, relay b %d", len(pa), len(pb))
		if len(pa)+len(pb) != n {
			t.Errorf("relays recorded %d+%d published rows, want %d in all", len(pa), len(pb), n)
		}
	})
}

// A relay that dies after the PubAcks arrived and before it marked the rows
// leaves them `sending`. After the lease, another relay publishes them again;
// JetStream recognizes the Nats-Msg-Id and stores nothing new.
func TestRelayDiesBetweenPubAckAndMark(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	const n = 20
	writeMany(t, h.db.Pool, n)

	acked := make(chan struct{})
	var once sync.Once
	dying := h.newRelay(func(c *Config) { c.Listen = false }, nil)
	dying.delivery.testHookBeforeRecord = func(ctx context.Context, _ []int64) {
		once.Do(func() { close(acked) })
		<-ctx.Done() // never record: the process dies here
	}
	h.start(dying)
	<-acked
	stopCtx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := dying.Stop(stopCtx); err == nil {
		t.Fatal("Stop of a relay stuck before recording returned no error")
	}

	if c := statusCounts(t, h.db.Pool); c["sending"] != n {
		t.Fatalf("after the PubAcks, before marking: %s, want all %d sending", formatCounts(c), n)
	}
	if got := len(h.streamMessages()); got != n {
		t.Fatalf("stream holds %d messages before the restart, want %d", got, n)
	}

	// The dead relay's lease ran out long ago; the new relay's own claims
	// must not expire while it works, however slow the machine.
	if _, err := h.db.Pool.Exec(context.Background(), `UPDATE outbox SET claimed_at = claimed_at - interval '1 hour' WHERE status = 'sending'`); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	h.startRelay(func(c *Config) {
		c.Lease = 30 * time.Second
		c.PublishTimeout = time.Second
		c.ReapInterval = 100 * time.Millisecond
	}, rec)
	h.waitAllSent(n, 30*time.Second)

	if got := len(h.streamMessages()); got != n {
		t.Fatalf("stream holds %d messages after the republish, want %d (duplicates must be dropped)", got, n)
	}
	published, reaped := rec.snapshot()
	if reaped != n {
		t.Errorf("reaped %d rows, want %d", reaped, n)
	}
	for _, p := range published {
		if !p.Duplicate {
			t.Errorf("event %d: second publish not reported as a duplicate by JetStream", p.ID)
		}
	}
}

// Rows an operator returns to the relays (`fanout outbox retry-failed`,
// `fanout outbox republish`) are published in both capture modes: a wal
// relay decodes the update that returns them. A row written `failed` by
// hand is not published until then, and one whose payload is stored out
// of line (TOAST, which an update that leaves it alone does not decode) is
// published whole.
func TestRowsReturnedByAnOperatorArePublished(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		rec := &recorder{}
		r := h.newRelay(nil, rec)
		const n = 10
		h.launch(r, func() { writeMany(t, h.db.Pool, n) })

		// Random hex barely compresses: far above the 2 kB at which Postgres
		// moves a value out of line.
		blob := make([]byte, 64<<10)
		_, _ = rand.Read(blob)
		big, err := json.Marshal(map[string]string{"product_id": "big", "blob": hex.EncodeToString(blob)})
		if err != nil {
			t.Fatal(err)
		}
		var bigID int64
		if err := h.db.Pool.QueryRow(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, last_error)
VALUES ('product', 'big', 'product.updated', $1::jsonb, 'failed', 'written failed by hand')
RETURNING id`, string(big)).Scan(&bigID); err != nil {
			t.Fatal(err)
		}
		// Stored larger than a page, it can only be out of line.
		var external bool
		if err := h.db.Pool.QueryRow(ctx, `SELECT pg_column_size(payload) > 8192 FROM outbox WHERE id = $1`, bigID).Scan(&external); err != nil || !external {
			t.Fatalf("the big payload is not stored out of line (%v): the test proves nothing", err)
		}
		// A row committed after it is published (in wal capture, in commit
		// order): the failed row was passed over, not waited for.
		writeMany(t, h.db.Pool, 1)
		h.waitAllSent(n+1, 30*time.Second)
		if h.wal() {
			// Confirmed past the marker, the slot is done with every
			// transaction before it, the failed row's included.
			var end string
			if err := h.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
				t.Fatal(err)
			}
			lsn, err := pglogrepl.ParseLSN(end)
			if err != nil {
				t.Fatal(err)
			}
			waitFor(t, 30*time.Second, "the slot confirmed past the marker", func() (bool, string) {
				return pglogrepl.LSN(r.wal.confirmedLSN.Load()) >= lsn, pglogrepl.LSN(r.wal.confirmedLSN.Load()).String()
			})
		}
		if got := h.streamCount(); got != n+1 {
			t.Fatalf("%d in the stream, want %d: a row written failed was published", got, n+1)
		}

		store := outboxstore.New(h.db.Pool)
		if k, err := store.RetryFailed(ctx); err != nil || k != 1 {
			t.Fatalf("retry-failed: %d rows (%v), want 1", k, err)
		}
		waitFor(t, 30*time.Second, "the retried row in the stream", func() (bool, string) {
			got := h.streamCount()
			return got == n+2, fmt.Sprintf("%d in the stream", got)
		})
		var stored *jetstream.RawStreamMsg
		for _, m := range h.streamMessages() {
			if m.Header.Get(wire.EventIDHeader) == strconv.FormatInt(bigID, 10) {
				stored = m
			}
		}
		if stored == nil || (!bytes.Equal(stored.Data, big) && !jsonEqual(stored.Data, big)) {
			t.Fatalf("the retried row's message: %v, want its whole payload", stored)
		}

		// Republish all of it: every row is published again, and JetStream
		// drops each one as a duplicate.
		k, _, err := store.Republish(ctx, time.Now().Add(-time.Minute))
		if err != nil || k != n+2 {
			t.Fatalf("republish: %d rows (%v), want %d", k, err, n+2)
		}
		waitFor(t, 30*time.Second, "every row published again", func() (bool, string) {
			published, _ := rec.snapshot()
			dups := 0
			for _, p := range published {
				if p.Duplicate {
					dups++
				}
			}
			return dups == n+2, fmt.Sprintf("%d of %d published again", dups, n+2)
		})
		assertEachOnce(t, h, n+2)
	})
}

// jsonEqual compares two JSON documents by value (jsonb orders keys).
func jsonEqual(a, b []byte) bool {
	var va, vb any
	return json.Unmarshal(a, &va) == nil && json.Unmarshal(b, &vb) == nil && reflect.DeepEqual(va, vb)
}

// The sweeper walks the rows below the floor a window at a time and goes
// round: late rows spread over more windows than one sweep walks, behind
// a window's worth of rows that can never go, are all published.
func TestSweeperGoesRoundTheRowsBelowTheFloor(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	// A failed row and the events it holds: the first rows of every walk
	// from the lowest id, never claimed.
	writeHeldOrder(t, h.db.Pool, 5)
	r := h.newRelay(nil, nil)
	r.sweeper.testWindow = 3
	h.start(r)

	// Ten transactions take their ids and stay open while the floor
	// passes them, on connections of their own (the relay's pool is the
	// test's).
	var late []pgx.Tx
	var lastLate int64
	for i := range 10 {
		conn, err := pgx.Connect(ctx, h.db.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx) //nolint:errcheck
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		if lastLate, err = outbox.Write(ctx, tx, productEvent(1000+i)); err != nil {
			t.Fatal(err)
		}
		late = append(late, tx)
		writeMany(t, h.db.Pool, 2)
	}
	n := 20 + writeUntilFloorPasses(t, h, r, lastLate)
	waitFor(t, 20*time.Second, "the rows committed so far published", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return c["sent"] == n, formatCounts(c)
	})
	for _, tx := range late {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// Six windows at least (3 rows each), a sweep a second.
	waitFor(t, 30*time.Second, "the late rows published", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return c["sent"] == n+10, formatCounts(c)
	})
	if c := statusCounts(t, h.db.Pool); c["failed"] != 1 || c["pending"] != 5 {
		t.Fatalf("the held order: %s, want 1 failed and 5 pending", formatCounts(c))
	}
}

// Above the floor, a claim walks a window of rows by id (twice
// relay.max_in_flight); past it, it goes round the aggregates. An
// aggregate's event behind more held events than a window holds is still
// claimed at once.
func TestHeadBehindABacklogLargerThanTheClaimWindowIsPublished(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	writeHeldOrder(t, h.db.Pool, 60)
	behind := write(t, h.db.Pool, outbox.Event{AggregateType: "order", AggregateID: "free", Type: "order.updated", Payload: map[string]int{"n": 0}})[0]

	// A claim walks 2 × 5 = 10 rows by id: the failed row and 9 held ones.
	h.startRelay(func(c *Config) { c.BatchSize, c.MaxInFlight = 5, 5 }, nil)
	waitFor(t, 10*time.Second, "the free order's event published past the held backlog", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return c["sent"] == 1 && c["failed"] == 1, formatCounts(c)
	})
	var status string
	if err := h.db.Pool.QueryRow(ctx, `SELECT status FROM outbox WHERE id = $1`, behind).Scan(&status); err != nil || status != "sent" {
		t.Fatalf("the free order's event: %s (%v), want sent", status, err)
	}
	if c := statusCounts(t, h.db.Pool); c["pending"] != 60 {
		t.Fatalf("held: %s, want 60 pending behind the failed row", formatCounts(c))
	}
}

// writeUntilFloorPasses commits rows until r's claim floor is above id,
// and returns how many it committed.
func writeUntilFloorPasses(t *testing.T, h *harness, r *Relay, id int64) int {
	t.Helper()
	n := 0
	waitFor(t, 15*time.Second, "the claim floor above the open transactions' rows", func() (bool, string) {
		writeMany(t, h.db.Pool, 5)
		n += 5
		time.Sleep(50 * time.Millisecond)
		return r.floor.after.Load() > id, fmt.Sprintf("floor %d, row %d", r.floor.after.Load(), id)
	})
	return n
}

// writeHeldOrder writes, for order "held", a row that can never be
// published (a writer in another language stored headers that are not
// strings: it becomes failed and holds its aggregate) and n events behind
// it.
func writeHeldOrder(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('order', 'held', 'order.updated', '{}', '{"x-count": 1}')`); err != nil {
		t.Fatal(err)
	}
	events := make([]outbox.Event, n)
	for i := range events {
		events[i] = outbox.Event{AggregateType: "order", AggregateID: "held", Type: "order.updated", Payload: map[string]int{"n": i}}
	}
	write(t, pool, events...)
}

// Most claims start from a floor near the newest rows. A row below it
// whose writer's transaction commits late (it took its id long before) is
// still published, by the full walk that runs every fullClaimEvery.
func TestLateCommitBelowTheClaimFloorIsPublished(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r := h.startRelay(nil, nil)
	ctx := context.Background()

	late, err := h.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx) //nolint:errcheck
	lateID, err := outbox.Write(ctx, late, productEvent(0))
	if err != nil {
		t.Fatal(err)
	}

	// Rows committed after it, for a few full walks: the floor passes it.
	n := writeUntilFloorPasses(t, h, r, lateID)
	h.waitAllSent(n, 20*time.Second)

	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitAllSent(n+1, 5*time.Second)
	assertEachOnce(t, h, n+1)
}
