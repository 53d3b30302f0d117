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
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// chainOneTx commits n events in one transaction, most of them one
// aggregate's (product 1), the others two more aggregates' between them,
// and returns their ids in commit order.
func chainOneTx(t *testing.T, h *harness, n int) []int64 {
	t.Helper()
	events := make([]outbox.Event, n)
	for i := range events {
		agg := 1
		if i%5 == 4 {
			agg = 2 + i%2
		}
		events[i] = outbox.Event{AggregateType: "product", AggregateID: strconv.Itoa(agg), Type: "product.updated",
			Payload: map[string]int{"product_id": agg, "version": i}}
	}
	return write(t, h.db.Pool, events...)
}

// atomicCheck asserts what a relay's atomic batches must leave: every
// event once, each aggregate's in order, and each landing recorded at
// the sequence the event is stored at. It returns how many messages came
// in an atomic batch (Nats-Batch-Id), and the events out of order or
// landed elsewhere than recorded.
func atomicCheck(t *testing.T, h *harness, n int) (batched int, bad []string) {
	t.Helper()
	msgs := h.streamMessages()
	atSeq := map[uint64]string{}
	seen := map[string]int{}
	for _, m := range msgs {
		id := m.Header.Get(wire.EventIDHeader)
		atSeq[m.Sequence] = id
		seen[id]++
		if m.Header.Get(jetstreamext.BatchIDHeader) != "" {
			batched++
		}
	}
	if len(seen) != n || len(msgs) != n {
		t.Fatalf("the stream holds %d messages of %d events, want %d events once each", len(msgs), len(seen), n)
	}
	rows, err := h.db.Pool.Query(context.Background(), `SELECT u.id, u.seq FROM outbox_landings l, unnest(l.event_ids, l.seqs) AS u(id, seq)`)
	if err != nil {
		t.Fatal(err)
	}
	landings, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) ([2]int64, error) {
		var l [2]int64
		err := row.Scan(&l[0], &l[1])
		return l, err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range landings {
		if got := atSeq[uint64(l[1])]; got != strconv.FormatInt(l[0], 10) {
			bad = append(bad, fmt.Sprintf("event %d's landing says sequence %d, which holds event %q", l[0], l[1], got))
		}
	}
	if len(landings) < n {
		t.Fatalf("%d landings recorded, want one per event (%d)", len(landings), n)
	}
	return batched, append(bad, outOfOrder(t, h)...)
}

// One transaction holding a long chain of one aggregate's events goes in
// atomic batches: every event once, in its aggregate's order, each
// landing where the stream has it. Sent backwards (the sabotage hook
// AtomicReversed), the same check finds the events out of order.
func TestAtomicBatchesCarryAChain(t *testing.T) {
	t.Parallel()
	const n = 2500
	for _, sabotage := range []bool{false, true} {
		name := "ordered"
		if sabotage {
			name = "reversed-hook"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			forEachCapture(t, func(t *testing.T, h *harness) {
				r := h.newRelay(nil, nil)
				r.hooks.AtomicReversed = sabotage
				h.launch(r, func() { chainOneTx(t, h, n) })
				h.waitAllSent(n, 60*time.Second)
				batched, bad := atomicCheck(t, h, n)
				if batched < n*9/10 {
					t.Fatalf("%d of %d events came in atomic batches: the test proves less than it claims", batched, n)
				}
				switch {
				case sabotage && len(bad) == 0:
					t.Fatalf("batches sent backwards left every event in order: the check proves nothing")
				case !sabotage && len(bad) > 0:
					t.Fatalf("%d events out of order or landed elsewhere, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
				}
				t.Logf("%d events, %d in atomic batches, %d out of order or landed elsewhere", n, batched, len(bad))
			})
		})
	}
}

// An atomic batch that fails, or that the stream refuses, leaves its
// events to go a wave at a time: still every event once and in order.
func TestAtomicBatchesFallBack(t *testing.T) {
	t.Parallel()
	const n = 2500

	t.Run("a batch that fails", func(t *testing.T) {
		t.Parallel()
		forEachCapture(t, func(t *testing.T, h *harness) {
			var mu sync.Mutex
			failed := 0
			r := h.newRelay(nil, nil)
			r.hooks.FailAtomic = func([]int64) bool { // the first three batches
				mu.Lock()
				defer mu.Unlock()
				failed++
				return failed <= 3
			}
			h.launch(r, func() { chainOneTx(t, h, n) })
			h.waitAllSent(n, 90*time.Second)
			batched, bad := atomicCheck(t, h, n)
			if len(bad) > 0 {
				t.Fatalf("%d events out of order, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
			}
			mu.Lock()
			defer mu.Unlock()
			if failed < 3 || batched == 0 {
				t.Fatalf("%d atomic batches tried, %d events in them: the test proves less than it claims", failed, batched)
			}
			t.Logf("%d events, %d in atomic batches, 3 batches failed", n, batched)
		})
	})

	t.Run("events already in the stream", func(t *testing.T) {
		t.Parallel()
		forEachCapture(t, func(t *testing.T, h *harness) {
			r := h.newRelay(nil, nil)
			h.launch(r, func() {
				// A relay that published these and died before its record:
				// the chain's first events are in the stream already, so
				// the batches holding them are refused as duplicates.
				ids := chainOneTx(t, h, n)
				pre, err := outboxstore.New(h.db.Pool).Unpublished(context.Background(), ids[:20])
				if err != nil || len(pre) != 20 {
					t.Fatalf("read the first rows: %d (%v)", len(pre), err)
				}
				js, err := jetstream.New(h.connect())
				if err != nil {
					t.Fatal(err)
				}
				if err := stream.Ensure(context.Background(), js, h.cfg.Stream, RepublishDelay(h.cfg.Relay), testLogger(t)); err != nil {
					t.Fatal(err)
				}
				for _, rw := range pre {
					msg, err := wire.Encode(h.cfg.Stream, h.identity(), rw, 1<<20)
					if err != nil {
						t.Fatal(err)
					}
					if _, err := js.PublishMsg(context.Background(), msg); err != nil {
						t.Fatal(err)
					}
				}
			})
			h.waitAllSent(n, 90*time.Second)
			batched, bad := atomicCheck(t, h, n)
			if len(bad) > 0 {
				t.Fatalf("%d events out of order, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
			}
			if batched == 0 {
				t.Fatal("no event came in an atomic batch after the duplicates: the relay gave them up")
			}
			t.Logf("%d events, 20 published before the relay, %d in atomic batches", n, batched)
		})
	})

	t.Run("a stream that does not allow them", func(t *testing.T) {
		t.Parallel()
		forEachCapture(t, func(t *testing.T, h *harness) {
			cfg := h.cfg.Stream
			cfg.Database = h.identity().Database.String()
			want := stream.JetStreamConfig(cfg)
			want.AllowAtomicPublish = false
			js, err := jetstream.New(h.connect())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := js.CreateStream(context.Background(), want); err != nil {
				t.Fatal(err)
			}
			h.cfg.Stream.Provision = "verify"
			r := h.newRelay(nil, nil)
			h.launch(r, func() { chainOneTx(t, h, n) })
			h.waitAllSent(n, 90*time.Second)
			batched, bad := atomicCheck(t, h, n)
			if len(bad) > 0 {
				t.Fatalf("%d events out of order, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
			}
			if batched > 0 {
				t.Fatalf("%d events came in atomic batches into a stream without allow_atomic", batched)
			}
			if r.publisher.atomicOK.Load() {
				t.Fatal("the relay takes the stream for one that allows atomic batches")
			}
		})
	})
}
