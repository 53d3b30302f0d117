package relay

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
)

// orderWriters commits perAggregate events for each of aggregates
// aggregates ("order" "0".."n-1"), from 4 writers at once, one event per
// transaction: the aggregates' events interleave and their writers race,
// so ids are not the aggregates' order. It returns how many it wrote.
func orderWriters(t *testing.T, h *harness, aggregates, perAggregate int) int {
	t.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < aggregates*perAggregate; i += 4 {
				ev := outbox.Event{AggregateType: "order", AggregateID: strconv.Itoa(i % aggregates), Type: "order.updated",
					Payload: map[string]int{"writer": w, "n": i}}
				if err := pgx.BeginFunc(ctx, h.db.Pool, func(tx pgx.Tx) error {
					_, err := outbox.Write(ctx, tx, ev)
					return err
				}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return aggregates * perAggregate
}

// outOfOrder reads the stream and returns every place where an
// aggregate's event is not the one after the aggregate's previous event
// in the stream (by Fanout-Aggregate-Seq), and checks that each event's
// number is its row's.
func outOfOrder(t *testing.T, h *harness) []string {
	t.Helper()
	want := map[string]int64{}
	rows, err := h.db.Pool.Query(context.Background(), `SELECT id, aggregate_seq FROM outbox`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, seq int64
		if err := rows.Scan(&id, &seq); err != nil {
			t.Fatal(err)
		}
		want[strconv.FormatInt(id, 10)] = seq
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	last := map[string]int64{}
	var bad []string
	for _, m := range h.streamMessages() {
		id := m.Header.Get(wire.EventIDHeader)
		agg := m.Header.Get(wire.AggregateTypeHeader) + "/" + m.Header.Get(wire.AggregateIDHeader)
		seq, err := strconv.ParseInt(m.Header.Get(wire.AggregateSeqHeader), 10, 64)
		if err != nil {
			t.Fatalf("event %s: %s header %q: %v", id, wire.AggregateSeqHeader, m.Header.Get(wire.AggregateSeqHeader), err)
		}
		if seq != want[id] {
			t.Fatalf("event %s carries number %d, its row has %d", id, seq, want[id])
		}
		if seq != last[agg]+1 {
			bad = append(bad, fmt.Sprintf("%s: event %s (number %d) after number %d", agg, id, seq, last[agg]))
		}
		last[agg] = max(last[agg], seq)
	}
	return bad
}

// flakyPublish fails the first publish of every third event, and the
// first three of every seventh.
func flakyPublish() func(id int64) bool {
	var mu sync.Mutex
	tries := map[int64]int{}
	return func(id int64) bool {
		mu.Lock()
		defer mu.Unlock()
		tries[id]++
		return (id%3 == 0 && tries[id] == 1) || (id%7 == 0 && tries[id] <= 3)
	}
}

// Per-aggregate order survives publishes that fail and are retried after
// a backoff, with three relays claiming at once (one streams in wal
// capture, the others stand by): every aggregate's events enter the
// stream as 1, 2, 3, ... With the order broken on purpose (the Unordered
// hook), the same run finds events out of order.
func TestAggregateOrderUnderPublishFailures(t *testing.T) {
	for _, broken := range []bool{false, true} {
		name := "ordered"
		if broken {
			name = "unordered-hook"
		}
		t.Run(name, func(t *testing.T) {
			forEachCapture(t, func(t *testing.T, h *harness) {
				var relays []*Relay
				fail := flakyPublish()
				for range 3 {
					r := h.newRelay(func(c *Config) { c.BatchSize = 5; c.MaxInFlight = 50 }, nil)
					r.hooks.FailPublish = fail
					r.hooks.Unordered = broken
					r.store.Unordered = broken
					relays = append(relays, r)
				}
				n := 0
				h.launch(relays[0], func() { n = orderWriters(t, h, 8, 30) })
				for _, r := range relays[1:] {
					h.start(r)
				}
				h.waitAllSent(n, 60*time.Second)
				bad := outOfOrder(t, h)
				switch {
				case broken && len(bad) == 0:
					t.Fatalf("the Unordered hook published %d events in order: the check proves nothing", n)
				case !broken && len(bad) > 0:
					t.Fatalf("%d events out of order, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
				}
				t.Logf("%d events, %d out of order", n, len(bad))
			})
		})
	}
}

// A failed event holds its aggregate's later events (relay.on_failed
// hold) and no other aggregate's, until an operator skips it or fixes
// and retries it; then they follow in order. With on_failed skip they
// pass it.
func TestFailedEventHoldsItsAggregate(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		store := outboxstore.New(h.db.Pool)
		good := func(agg string) int64 {
			return write(t, h.db.Pool, outbox.Event{AggregateType: "order", AggregateID: agg, Type: "order.updated", Payload: map[string]string{"order": agg}})[0]
		}
		// A writer in another language stores headers that are not strings:
		// the row can never be published.
		poison := func(agg string) int64 {
			var id int64
			if err := h.db.Pool.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('order', $1, 'order.updated', '{}', '{"x-count": 1}') RETURNING id`, agg).Scan(&id); err != nil {
				t.Fatal(err)
			}
			return id
		}
		inStream := func() map[string][]int64 {
			got := map[string][]int64{}
			for _, m := range h.streamMessages() {
				id, _ := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
				agg := m.Header.Get(wire.AggregateIDHeader)
				got[agg] = append(got[agg], id)
			}
			return got
		}
		r := h.newRelay(nil, nil)
		var a1, a2, a3, a4, b1, c1, c2, c3 int64
		h.launch(r, func() {
			a1, a2, a3, a4 = good("a"), poison("a"), good("a"), good("a")
			c1, c2, c3 = good("c"), poison("c"), good("c")
			b1 = good("b")
		})
		// A wal relay marks the held rows failed as it decodes them: wait
		// for all three.
		waitFor(t, 20*time.Second, "a1, c1 and b1 published, a2 and c2 failed, a3, a4 and c3 held", func() (bool, string) {
			got := inStream()
			c := statusCounts(t, h.db.Pool)
			rows, aggs, err := store.Held(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return len(got["a"]) == 1 && len(got["b"]) == 1 && len(got["c"]) == 1 && rows == 3 && aggs == 2,
				fmt.Sprintf("%v %s; held %d rows of %d aggregates", got, formatCounts(c), rows, aggs)
		})
		// Nothing more goes while they are held.
		if got := inStream(); len(got["a"]) != 1 || len(got["c"]) != 1 {
			t.Fatalf("published past a failed event: %v", got)
		}

		// Skip a2: a3 and a4 follow, in order.
		skipped, err := store.Skip(ctx, []int64{a2, b1})
		if err != nil || len(skipped) != 1 || skipped[0].ID != a2 {
			t.Fatalf("skip a2 and b1 (published): %v, %v; want a2 alone", skipped, err)
		}
		// Fix c2 (as an operator would, in SQL) and retry it: c2 then c3.
		if _, err := h.db.Pool.Exec(ctx, `UPDATE outbox SET headers = '{}' WHERE id = $1`, c2); err != nil {
			t.Fatal(err)
		}
		if _, err := store.RetryFailed(ctx); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 20*time.Second, "a3, a4, c2 and c3 published", func() (bool, string) {
			got := inStream()
			return len(got["a"]) == 3 && len(got["c"]) == 3, fmt.Sprint(got)
		})
		got := inStream()
		if fmt.Sprint(got["a"]) != fmt.Sprint([]int64{a1, a3, a4}) || fmt.Sprint(got["c"]) != fmt.Sprint([]int64{c1, c2, c3}) {
			t.Fatalf("stream order: a %v, c %v; want a %v, c %v", got["a"], got["c"], []int64{a1, a3, a4}, []int64{c1, c2, c3})
		}
		if bad := outOfOrder(t, h); len(bad) != 1 || !strings.Contains(bad[0], fmt.Sprintf("event %d (number 3) after number 1", a3)) {
			t.Fatalf("out of order: %v, want only a3 after the skipped a2", bad)
		}
		if rows, _, err := store.Held(ctx); err != nil || rows != 0 {
			t.Fatalf("held after the release: %d (%v)", rows, err)
		}
	})
}

func TestFailedEventSkippedByPolicy(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		r := h.newRelay(func(c *Config) { c.OnFailed = string(outboxstore.SkipFailed) }, nil)
		var ids []int64
		h.launch(r, func() {
			ids = write(t, h.db.Pool, outbox.Event{AggregateType: "order", AggregateID: "a", Type: "order.updated", Payload: map[string]int{"n": 1}})
			var poison int64
			if err := h.db.Pool.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('order', 'a', 'order.updated', '{}', '{"x-count": 1}') RETURNING id`).Scan(&poison); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, write(t, h.db.Pool, outbox.Event{AggregateType: "order", AggregateID: "a", Type: "order.updated", Payload: map[string]int{"n": 3}})...)
		})
		h.waitAllSent(2, 20*time.Second)
		waitFor(t, 20*time.Second, "the poison row failed", func() (bool, string) {
			c := statusCounts(t, h.db.Pool)
			return c["failed"] == 1, formatCounts(c)
		})
		msgs := h.streamMessages()
		if len(msgs) != 2 || msgs[0].Header.Get(wire.EventIDHeader) != strconv.FormatInt(ids[0], 10) || msgs[1].Header.Get(wire.EventIDHeader) != strconv.FormatInt(ids[1], 10) {
			t.Fatalf("stream holds %d events, want %v past the failed one", len(msgs), ids)
		}
	})
}

// A relay that claimed a batch and stalls before publishing it (as one
// killed there would: its rows stay sending under its lease) holds its
// aggregates' next events until the reaper returns its rows; another
// relay then publishes them and goes on in order. The unordered claim
// publishes the next events at once, ahead of them.
func TestAggregateOrderWhenARelayStallsMidBatch(t *testing.T) {
	for _, broken := range []bool{false, true} {
		t.Run(fmt.Sprintf("unordered=%t", broken), func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			n := orderWriters(t, h, 4, 10)
			stalled := h.newRelay(func(c *Config) {
				c.BatchSize = 4
				c.Lease, c.PublishTimeout = time.Second, 500*time.Millisecond
				c.ReapInterval = 100 * time.Millisecond
			}, nil)
			stall := make(chan struct{})
			claimed := make(chan struct{}, 1)
			stalled.hooks.FailPublish = func(int64) bool {
				select {
				case claimed <- struct{}{}:
				default:
				}
				<-stall
				return true
			}
			h.start(stalled)
			<-claimed
			defer close(stall) // lets the stalled relay stop at the end
			other := h.newRelay(func(c *Config) {
				c.Lease, c.PublishTimeout = time.Second, 500*time.Millisecond
				c.ReapInterval = 100 * time.Millisecond
			}, nil)
			other.hooks.Unordered, other.store.Unordered = broken, broken
			h.start(other)
			waitFor(t, 30*time.Second, "every event in the stream", func() (bool, string) {
				got := h.streamCount()
				return got == n, fmt.Sprintf("%d of %d", got, n)
			})
			bad := outOfOrder(t, h)
			if broken != (len(bad) > 0) {
				t.Fatalf("unordered claim %t: %d events out of order: %v", broken, len(bad), bad)
			}
		})
	}
}

// Events of a type the outbox does not number (outbox numbering) are
// published beside their aggregate's numbered events, with flaky
// publishes and three relays, in both captures: every one of them once,
// without a number, and the numbered ones still as 1, 2, 3, ...
func TestUnnumberedEventsGoBesideNumberedOnes(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		if err := outboxstore.New(h.db.Pool).SetNumbering(ctx, []string{"order.noted"}); err != nil {
			t.Fatal(err)
		}
		var relays []*Relay
		fail := flakyPublish()
		for range 3 {
			r := h.newRelay(func(c *Config) { c.BatchSize = 5; c.MaxInFlight = 50 }, nil)
			r.hooks.FailPublish = fail
			relays = append(relays, r)
		}
		const n = 240
		h.launch(relays[0], func() {
			for i := range n {
				typ := "order.updated"
				if i%3 == 0 {
					typ = "order.noted"
				}
				write(t, h.db.Pool, outbox.Event{AggregateType: "order", AggregateID: strconv.Itoa(i % 8), Type: typ, Payload: map[string]int{"n": i}})
			}
		})
		for _, r := range relays[1:] {
			h.start(r)
		}
		h.waitAllSent(n, 60*time.Second)

		last := map[string]int64{}
		seen := map[string]bool{}
		var unnumbered int
		var bad []string
		for _, m := range h.streamMessages() {
			id, typ := m.Header.Get(wire.EventIDHeader), m.Header.Get(wire.EventTypeHeader)
			if seen[id] {
				continue
			}
			seen[id] = true
			agg := m.Header.Get(wire.AggregateIDHeader)
			number := m.Header.Get(wire.AggregateSeqHeader)
			if typ == "order.noted" {
				unnumbered++
				if number != "" {
					bad = append(bad, fmt.Sprintf("unnumbered event %s carries number %s", id, number))
				}
				continue
			}
			seq, err := strconv.ParseInt(number, 10, 64)
			if err != nil || seq != last[agg]+1 {
				bad = append(bad, fmt.Sprintf("order %s: event %s (number %q) after number %d", agg, id, number, last[agg]))
			}
			last[agg] = max(last[agg], seq)
		}
		if len(seen) != n || unnumbered != n/3 {
			t.Errorf("the stream holds %d events, %d of them unnumbered; want %d and %d", len(seen), unnumbered, n, n/3)
		}
		if len(bad) > 0 {
			t.Errorf("%d wrong, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
		}
	})
}
