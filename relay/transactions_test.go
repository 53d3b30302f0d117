package relay

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// Transactions (relay.atomic transaction): each writer's transaction enters
// the stream whole, in chunks, or not at all, in both captures.

// txCheck reads the stream against the outbox's transactions (their rows'
// writer_xid, Postgres's word, not the relay's; a poll relay's rows may
// still be `sending`, published but not yet recorded) and returns how
// many transactions it checked and what is wrong: every transaction's
// events once each, in chunks of at most 1000 that are each one run of
// consecutive sequences, numbered from 1 with the last one marked.
func txCheck(t *testing.T, h *harness) (txs int, bad []string) {
	t.Helper()
	byID := map[int64]*jetstream.RawStreamMsg{}
	for _, m := range h.streamMessages() {
		id, err := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
		if err != nil {
			t.Fatalf("message %d: %v", m.Sequence, err)
		}
		if byID[id] != nil {
			bad = append(bad, fmt.Sprintf("event %d twice, at %d and %d", id, byID[id].Sequence, m.Sequence))
			continue
		}
		byID[id] = m
	}
	rows, err := h.db.Pool.Query(context.Background(), `SELECT writer_xid::text, array_agg(id ORDER BY id) FROM outbox WHERE status <> 'failed' GROUP BY writer_xid`)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) ([]int64, error) {
		var xmin string
		var ids []int64
		err := row.Scan(&xmin, &ids)
		return ids, err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, ids := range groups {
		txs++
		var msgs []*jetstream.RawStreamMsg
		for _, id := range ids {
			m := byID[id]
			if m == nil {
				bad = append(bad, fmt.Sprintf("event %d is not in the stream", id))
				continue
			}
			msgs = append(msgs, m)
		}
		slices.SortFunc(msgs, func(a, b *jetstream.RawStreamMsg) int { return cmp.Compare(a.Sequence, b.Sequence) })
		chunks := (len(ids) + atomicMax - 1) / atomicMax
		tx := ""
		for i, m := range msgs {
			chunk := i/atomicMax + 1
			want := []string{strconv.Itoa(chunk), ""}
			if chunk == chunks {
				want[1] = "true"
			}
			got := []string{m.Header.Get(wire.TxChunkHeader), m.Header.Get(wire.TxLastHeader)}
			if i == 0 {
				tx = m.Header.Get(wire.TxHeader)
			}
			if m.Header.Get(wire.TxHeader) != tx || tx == "" || !slices.Equal(got, want) {
				bad = append(bad, fmt.Sprintf("event %s of transaction %s marked %s chunk %v, want %s chunk %v", m.Header.Get(wire.EventIDHeader),
					tx, m.Header.Get(wire.TxHeader), got, tx, want))
			}
			if i%atomicMax > 0 && m.Sequence != msgs[i-1].Sequence+1 {
				bad = append(bad, fmt.Sprintf("transaction %s chunk %d: %d other messages between sequences %d and %d",
					tx, chunk, m.Sequence-msgs[i-1].Sequence-1, msgs[i-1].Sequence, m.Sequence))
			}
		}
	}
	return txs, bad
}

// writeSmallTxs commits transactions of two events, of aggregates of
// their own, until stop is closed: their events land between the
// transaction's under test if it is not one batch.
func writeSmallTxs(h *harness, stop <-chan struct{}) (written int, err error) {
	ctx := context.Background()
	for i := 0; ; i++ {
		select {
		case <-stop:
			return written, nil
		default:
		}
		if err := pgx.BeginFunc(ctx, h.db.Pool, func(tx pgx.Tx) error {
			for _, e := range []outbox.Event{productEvent(10_000 + i), productEvent(20_000 + i)} {
				if _, err := outbox.Write(ctx, tx, e); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			return written, err
		}
		written += 2
	}
}

// With relay.atomic transaction, each writer transaction enters the
// stream as one atomic batch, in chunks of 1000 when it is larger, while
// other transactions are written beside it: a row that can never be
// published is marked failed, with the row of its aggregate behind it,
// and the rest of its transaction goes without them. Published as two
// batches each (the sabotage hook SplitTransactions), the same check
// finds other events between a transaction's.
func TestTransactionsEnterTheStreamWhole(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		capture  string
		sabotage bool
	}{{CaptureWAL, false}, {CaptureWAL, true}, {CapturePoll, false}, {CapturePoll, true}} {
		sabotage := tc.sabotage
		name := tc.capture + "/whole"
		if sabotage {
			name = tc.capture + "/split-hook"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			h.cfg.Relay.Capture = tc.capture
			h.cfg.Relay.Atomic = AtomicTransaction
			r := h.newRelay(nil, nil)
			r.hooks.SplitTransactions = sabotage
			var small int
			var poison, behind int64
			h.launch(r, func() {
				stop := make(chan struct{})
				done := make(chan error)
				go func() {
					var err error
					small, err = writeSmallTxs(h, stop)
					done <- err
				}()
				defer func() {
					close(stop)
					if err := <-done; err != nil {
						t.Fatal(err)
					}
				}()
				write(t, h.db.Pool, productEvent(1), productEvent(2), productEvent(3))
				big := make([]outbox.Event, 2500)
				for i := range big {
					big[i] = productEvent(1 + i%50)
				}
				write(t, h.db.Pool, big...)
				// A writer in another language stores headers that are not
				// strings: that row can never be published, and the next
				// event of its aggregate waits behind it.
				ctx := context.Background()
				if err := pgx.BeginFunc(ctx, h.db.Pool, func(tx pgx.Tx) error {
					if _, err := outbox.Write(ctx, tx, productEvent(7)); err != nil {
						return err
					}
					if err := tx.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('product', '8', 'product.updated', '{}', '{"x-count": 1}') RETURNING id`).Scan(&poison); err != nil {
						return err
					}
					var err error
					if behind, err = outbox.Write(ctx, tx, productEvent(8)); err != nil {
						return err
					}
					_, err = outbox.Write(ctx, tx, productEvent(9))
					return err
				}); err != nil {
					t.Fatal(err)
				}
				time.Sleep(300 * time.Millisecond) // small transactions beside the last
			})
			want := 3 + 2500 + 2 + small
			waitFor(t, 90*time.Second, "every publishable event in the stream", func() (bool, string) {
				n := h.streamCount()
				return n >= want, fmt.Sprintf("%d of %d", n, want)
			})
			var status, reason string
			for id, wantReason := range map[int64]string{poison: "headers", behind: outboxstore.HeldBehindReason(poison)} {
				waitFor(t, 10*time.Second, fmt.Sprintf("row %d failed", id), func() (bool, string) {
					if err := h.db.Pool.QueryRow(context.Background(), `SELECT status, coalesce(last_error, '') FROM outbox WHERE id = $1`, id).Scan(&status, &reason); err != nil {
						t.Fatal(err)
					}
					return status == "failed" && strings.Contains(reason, wantReason), status + ": " + reason
				})
			}
			txs, bad := txCheck(t, h)
			if txs < 3+small/2 {
				t.Fatalf("%d transactions checked, want at least %d", txs, 3+small/2)
			}
			switch {
			case sabotage && len(bad) == 0:
				t.Fatalf("transactions published as two batches each, %d of them, all found whole: the check proves nothing", txs)
			case !sabotage && len(bad) > 0:
				t.Fatalf("%d problems, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
			}
			t.Logf("%d transactions (%d small ones beside), %d problems", txs, small/2, len(bad))
		})
	}
}

// With relay.atomic transaction, a transaction of one event is one
// publish, not an atomic batch (a single message is stored whole or not
// at all; a batch of one cost the stream's batch commit), still marked as
// its transaction's one and last chunk; a larger one is one batch.
func TestOneEventTransactionsNeedNoBatch(t *testing.T) {
	t.Parallel()
	for _, capture := range []string{CapturePoll, CaptureWAL} {
		t.Run(capture, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			h.cfg.Relay.Capture = capture
			h.cfg.Relay.Atomic = AtomicTransaction
			rec := &atomicRecorder{}
			r := h.newRelay(nil, rec)
			h.launch(r, func() {
				for i := range 20 {
					write(t, h.db.Pool, productEvent(1+i%4))
				}
				write(t, h.db.Pool, productEvent(1), productEvent(2), productEvent(3))
			})
			// Reported once recorded: the batch's report came before.
			waitFor(t, 30*time.Second, "every event published and recorded", func() (bool, string) {
				published, _ := rec.snapshot()
				return len(published) >= 23, fmt.Sprintf("%d of 23", len(published))
			})
			if sent, refused := rec.batches(); sent != 1 || refused != 0 {
				t.Errorf("%d atomic batches sent (%d refused), want 1: the transaction of three events", sent, refused)
			}
			txs, bad := txCheck(t, h)
			if txs != 21 || len(bad) > 0 {
				t.Fatalf("%d transactions checked, want 21; %d problems: %v", txs, len(bad), bad[:min(5, len(bad))])
			}
		})
	}
}

// With relay.atomic transaction, a wal relay publishes its slot's backlog
// (the transactions committed before the slot existed, which it claims
// as a poll relay does) by transactions too: each one batch, a larger
// one in ordered chunks, and then the transactions the slot decodes.
// Published event by event (the hook BacklogByEvent: as before the
// backlog's snapshot was kept, migration 00023), the same check finds
// the backlog's transactions without their batches.
func TestWALBacklogEntersTheStreamByTransactions(t *testing.T) {
	t.Parallel()
	for _, byEvent := range []bool{false, true} {
		name := "by-transaction"
		if byEvent {
			name = "by-event-hook"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newWALHarness(t)
			h.cfg.Relay.Atomic = AtomicTransaction
			written := 0
			for i := range 20 { // a poll relay's backlog: nobody published these
				written += len(write(t, h.db.Pool, productEvent(1+i%5), productEvent(6+i%5), productEvent(11)))
			}
			big := make([]outbox.Event, 1500)
			for i := range big {
				big[i] = productEvent(1 + i%40)
			}
			written += len(write(t, h.db.Pool, big...))
			r := h.newRelay(nil, nil)
			r.hooks.BacklogByEvent = byEvent
			h.start(r)
			h.waitStreaming(r)
			for i := range 10 { // the slot's
				written += len(write(t, h.db.Pool, productEvent(1+i%5), productEvent(11)))
			}
			h.waitAllSent(written, 60*time.Second)
			var done bool
			if err := h.db.Pool.QueryRow(context.Background(),
				`SELECT backlog_done_at IS NOT NULL FROM relay_capture WHERE slot_name = $1`, h.db.Name).Scan(&done); err != nil || !done {
				t.Fatalf("the slot's backlog recorded done: %t (%v)", done, err)
			}
			txs, bad := txCheck(t, h)
			if txs != 31 {
				t.Fatalf("%d transactions checked, want 31", txs)
			}
			switch {
			case byEvent && len(bad) == 0:
				t.Fatal("the backlog published event by event, and every transaction found whole: the check proves nothing")
			case !byEvent && len(bad) > 0:
				t.Fatalf("%d problems, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
			}
			assertEachOnce(t, h, written)
			t.Logf("%d transactions, %d problems", txs, len(bad))
		})
	}
}

// A relay killed in the middle of an atomic batch leaves none of the
// batch's events in the stream; the next relay publishes the whole
// transaction, once.
func TestATransactionHalfSentIsNotInTheStream(t *testing.T) {
	t.Parallel()
	for _, capture := range []string{CaptureWAL, CapturePoll} {
		t.Run(capture, func(t *testing.T) {
			t.Parallel()
			testATransactionHalfSent(t, capture)
		})
	}
}

func testATransactionHalfSent(t *testing.T, capture string) {
	h := newHarness(t)
	h.cfg.Relay.Capture = capture
	h.cfg.Relay.Atomic = AtomicTransaction
	first := h.newRelay(nil, nil)
	halfway := make(chan struct{})
	killed := make(chan struct{})
	var once sync.Once
	first.hooks.MidBatch = func() {
		once.Do(func() {
			close(halfway)
			<-killed
		})
	}
	const n = 600
	events := make([]outbox.Event, n)
	for i := range events {
		events[i] = productEvent(i)
	}
	h.launch(first, func() { write(t, h.db.Pool, events...) })
	select {
	case <-halfway:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay never sent half a batch")
	}
	if got := h.streamCount(); got != 0 {
		t.Fatalf("half a batch sent, uncommitted: the stream holds %d messages", got)
	}
	// Killed: its connection gone, the rest of the batch and its commit
	// never sent.
	first.nc.Close()
	close(killed)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = first.Stop(ctx)
	cancel()
	if got := h.streamCount(); got != 0 {
		t.Fatalf("after the kill, the stream holds %d messages of the half-sent batch", got)
	}

	second := h.newRelay(nil, nil)
	h.start(second)
	waitFor(t, 60*time.Second, "the transaction published by the next relay", func() (bool, string) {
		got := h.streamCount()
		return got >= n, fmt.Sprintf("%d of %d", got, n)
	})
	txs, bad := txCheck(t, h)
	if txs != 1 || len(bad) > 0 {
		t.Fatalf("%d transactions, problems: %v", txs, bad)
	}
}

// With relay.atomic transaction, a stream that does not allow atomic
// batches gets nothing: the relay waits, as for any outage, and publishes
// each transaction whole once the stream allows them.
func TestTransactionsWaitForAStreamThatAllowsThem(t *testing.T) {
	t.Parallel()
	for _, capture := range []string{CaptureWAL, CapturePoll} {
		t.Run(capture, func(t *testing.T) {
			t.Parallel()
			testTransactionsWaitForAtomic(t, capture)
		})
	}
}

func testTransactionsWaitForAtomic(t *testing.T, capture string) {
	h := newHarness(t)
	h.cfg.Relay.Capture = capture
	h.cfg.Relay.Atomic = AtomicTransaction
	h.cfg.Stream.Provision = "verify"
	h.cfg.Stream.CheckInterval = 200 * time.Millisecond
	cfg := h.cfg.Stream
	cfg.Database = h.identity().Database.String()
	want := stream.JetStreamConfig(cfg)
	want.AllowAtomicPublish = false
	js, err := jetstream.New(h.connect())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, want); err != nil {
		t.Fatal(err)
	}
	r := h.newRelay(nil, nil)
	h.launch(r, func() { write(t, h.db.Pool, productEvent(1), productEvent(2), productEvent(3)) })
	time.Sleep(time.Second)
	if got := h.streamCount(); got != 0 {
		t.Fatalf("a stream without allow_atomic holds %d events of a transaction", got)
	}
	want.AllowAtomicPublish = true
	if _, err := js.UpdateStream(ctx, want); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the transaction published once the stream allows it", func() (bool, string) {
		n := h.streamCount()
		return n == 3, fmt.Sprint(n)
	})
	if txs, bad := txCheck(t, h); txs != 1 || len(bad) > 0 {
		t.Fatalf("%d transactions, problems: %v", txs, bad)
	}
}

// A poll relay with relay.atomic transaction whose claim window holds
// only transactions waiting behind an event further up goes on to the
// windows after it, finds that event's transaction, and then the rest:
// nothing waits for ever. Here the window holds two rows, both of a
// transaction x that waits for e (committed first, its row after x's
// first 20), ten windows up. Claimed from the lowest id every time,
// nothing would ever be published.
func TestPollTransactionsGoRoundABacklog(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.cfg.Relay.Capture = CapturePoll
	h.cfg.Relay.Atomic = AtomicTransaction
	r := h.newRelay(nil, nil)
	r.tx.testWindow = 2
	ctx := context.Background()
	var xIDs []int64
	var eID int64
	h.launch(r, func() {
		x, err := h.db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer x.Rollback(ctx) //nolint:errcheck // committed below
		for n := range 20 {
			id, err := outbox.Write(ctx, x, productEvent(100+n))
			if err != nil {
				t.Fatal(err)
			}
			xIDs = append(xIDs, id)
		}
		eID = write(t, h.db.Pool, productEvent(3))[0]
		id, err := outbox.Write(ctx, x, productEvent(3))
		if err != nil {
			t.Fatal(err)
		}
		xIDs = append(xIDs, id)
		if err := x.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	})
	waitFor(t, 30*time.Second, "both transactions in the stream", func() (bool, string) {
		n := h.streamCount()
		return n == 22, fmt.Sprint(n)
	})
	var order []int64
	for _, m := range h.streamMessages() {
		id, _ := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
		order = append(order, id)
	}
	if order[0] != eID {
		t.Fatalf("stream order %v, want e (%d) first, then x %v", order, eID, xIDs)
	}
	if txs, bad := txCheck(t, h); txs != 2 || len(bad) > 0 {
		t.Fatalf("%d transactions, problems: %v", txs, bad)
	}
}

// A poll relay claims a big transaction's next chunks while one
// publishes, and publishes each only once the chunks before it are in the
// stream: when the stream does not store the second chunk (the test hook
// FailAtomic, once), the chunks after it go back to wait with it, no
// attempt counted, and the transaction lands whole and in order. A row
// that can never be published holds its aggregate's events in the chunks
// after it too, claimed before it was marked failed.
func TestPollTransactionChunksFollowInOrder(t *testing.T) {
	t.Parallel()
	t.Run("refused-chunk", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		h.cfg.Relay.Capture = CapturePoll
		h.cfg.Relay.Atomic = AtomicTransaction
		r := h.newRelay(nil, nil)
		var calls atomic.Int32
		r.hooks.FailAtomic = func([]int64) bool { return calls.Add(1) == 2 } // the second chunk, the first time
		const n = 3500
		events := make([]outbox.Event, n)
		for i := range events {
			events[i] = productEvent(i % 50)
		}
		h.launch(r, func() { write(t, h.db.Pool, events...) })
		h.waitAllSent(n, 90*time.Second)
		if calls.Load() < 5 {
			t.Fatalf("%d atomic batches, want the transaction's 4 chunks and the refused one again", calls.Load())
		}
		if _, bad := atomicCheck(t, h, n); len(bad) > 0 {
			t.Fatalf("%d problems, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
		}
		if txs, bad := txCheck(t, h); txs != 1 || len(bad) > 0 {
			t.Fatalf("%d transactions, problems: %v", txs, bad[:min(5, len(bad))])
		}
		var tried, attempts int
		if err := h.db.Pool.QueryRow(context.Background(), `SELECT count(*), coalesce(sum(attempts), 0) FROM outbox WHERE attempts > 0`).Scan(&tried, &attempts); err != nil {
			t.Fatal(err)
		}
		if tried != 1000 || attempts != 1000 {
			t.Fatalf("%d rows with %d failed attempts, want the refused chunk's 1000 with one each", tried, attempts)
		}
	})
	t.Run("held-across-chunks", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		h.cfg.Relay.Capture = CapturePoll
		h.cfg.Relay.Atomic = AtomicTransaction
		r := h.newRelay(nil, nil)
		ctx := context.Background()
		var poison int64
		var behind []int64
		h.launch(r, func() {
			if err := pgx.BeginFunc(ctx, h.db.Pool, func(tx pgx.Tx) error {
				for i := range 1500 {
					e := productEvent(100 + i%50)
					switch {
					case i == 999: // the first chunk's last row
						if err := tx.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('product', '8', 'product.updated', '{}', '{"x-count": 1}') RETURNING id`).Scan(&poison); err != nil {
							return err
						}
						continue
					case i >= 1000 && i < 1010: // its aggregate's next events, in the second chunk
						e = productEvent(8)
					}
					id, err := outbox.Write(ctx, tx, e)
					if err != nil {
						return err
					}
					if e.AggregateID == "8" {
						behind = append(behind, id)
					}
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
		})
		const want = 1500 - 1 - 10
		waitFor(t, 60*time.Second, "every publishable event in the stream", func() (bool, string) {
			n := h.streamCount()
			return n >= want, fmt.Sprintf("%d of %d", n, want)
		})
		waitFor(t, 10*time.Second, "the transaction's rows all recorded", func() (bool, string) {
			var open int
			if err := h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')`).Scan(&open); err != nil {
				t.Fatal(err)
			}
			return open == 0, fmt.Sprintf("%d rows still pending or sending", open)
		})
		for _, id := range append([]int64{poison}, behind...) {
			var status, reason string
			if err := h.db.Pool.QueryRow(ctx, `SELECT status, coalesce(last_error, '') FROM outbox WHERE id = $1`, id).Scan(&status, &reason); err != nil {
				t.Fatal(err)
			}
			wantReason := outboxstore.HeldBehindReason(poison)
			if id == poison {
				wantReason = "headers"
			}
			if status != "failed" || !strings.Contains(reason, wantReason) {
				t.Fatalf("row %d (aggregate 8) is %s (%q), want failed: %s", id, status, reason, wantReason)
			}
		}
		if n := h.streamCount(); n != want {
			t.Fatalf("the stream holds %d events, want %d", n, want)
		}
		if bad := outOfOrder(t, h); len(bad) > 0 {
			t.Fatalf("%d problems, first: %s", len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
		}
	})
}
