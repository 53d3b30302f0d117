package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
)

func newWALHarness(t *testing.T) *harness {
	t.Helper()
	h := newHarness(t)
	h.cfg.Relay.Capture = CaptureWAL
	return h
}

// Rows committed before the slot existed are not in its stream: a relay
// switched from poll to wal capture claims and publishes them, and decodes
// the rest.
func TestWALPublishesRowsCommittedBeforeTheSlot(t *testing.T) {
	t.Parallel()
	h := newWALHarness(t)
	writeMany(t, h.db.Pool, 700) // a poll relay's backlog: nobody published these
	r := h.startRelay(nil, nil)
	h.waitStreaming(r)
	writeMany(t, h.db.Pool, 300)
	h.waitAllSent(1000, 30*time.Second)

	c := statusCounts(t, h.db.Pool)
	if c["sent"] != 700 || c["pending"] != 300 {
		t.Errorf("outbox after the switch: %s, want the 700 older rows sent by claim and the 300 newer left to the slot", formatCounts(c))
	}
	var through int64
	var done bool
	if err := h.db.Pool.QueryRow(context.Background(),
		`SELECT backlog_through, backlog_done_at IS NOT NULL FROM relay_capture WHERE slot_name = $1`, h.db.Name).Scan(&through, &done); err != nil {
		t.Fatal(err)
	}
	if through != 700 || !done {
		t.Errorf("relay_capture: backlog through %d, done %t; want through 700 and done", through, done)
	}
	assertEachOnce(t, h, 1000)
}

// A relay killed after its events' PubAcks and before it confirmed the slot
// past them: the next relay decodes them again from the slot and publishes
// them again, and JetStream drops every one as a duplicate. With
// relay.atomic transaction, the next relay finds each transaction in the
// stream where it landed and sends no batch at all (each would be refused
// whole for its duplicates, then go one by one).
func TestWALRelayKilledBeforeConfirmingPublishesAgain(t *testing.T) {
	t.Parallel()
	for _, atomic := range []string{AtomicEvent, AtomicTransaction} {
		t.Run(atomic, func(t *testing.T) {
			t.Parallel()
			h := newWALHarness(t)
			h.cfg.Relay.Atomic = atomic
			const txs, perTx = 10, 5
			const n = txs * perTx
			acked := make(chan struct{})
			var once sync.Once
			dying := h.newRelay(nil, nil)
			dying.wal.testHookBeforeConfirm = func(ctx context.Context, _ pglogrepl.LSN) {
				once.Do(func() { close(acked) })
				<-ctx.Done() // never confirm: the process dies here
			}
			h.launch(dying, func() {
				for tx := range txs {
					var events []outbox.Event
					for i := range perTx {
						events = append(events, productEvent(tx*perTx+i+1))
					}
					write(t, h.db.Pool, events...)
				}
			})
			<-acked
			h.waitAllSent(n, 10*time.Second)
			stopCtx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			if err := dying.Stop(stopCtx); err == nil {
				t.Fatal("Stop of a relay stuck before confirming returned no error")
			}

			rec := &atomicRecorder{}
			h.startRelay(nil, rec)
			waitFor(t, 20*time.Second, "the next relay to publish every event again", func() (bool, string) {
				published, _ := rec.snapshot()
				return len(published) == n, strings.Repeat("|", len(published))
			})
			published, _ := rec.snapshot()
			for _, p := range published {
				if !p.Duplicate {
					t.Errorf("event %d: second publish not reported as a duplicate by JetStream", p.ID)
				}
			}
			if atomic == AtomicTransaction {
				if sent, refused := rec.batches(); sent != 0 {
					t.Errorf("the next relay sent %d atomic batches (%d refused) for transactions the stream holds", sent, refused)
				}
			}
			assertEachOnce(t, h, n)
		})
	}
}

// atomicRecorder is a recorder that counts atomic batches too.
type atomicRecorder struct {
	recorder
	sent, refused atomic.Int64
}

func (r *atomicRecorder) AtomicBatch(_ int, err error) {
	r.sent.Add(1)
	if err != nil {
		r.refused.Add(1)
	}
}

func (r *atomicRecorder) batches() (sent, refused int64) { return r.sent.Load(), r.refused.Load() }

// A relay decodes again what its slot had not confirmed: events published
// already, which JetStream drops as duplicates, unless the stream lost them
// meanwhile (its store rolled back). The copy stored then is a repair and
// says where the earlier one was lost from (Fanout-Repaired-From), as the
// auditor's repairs do: without it, nobody can tell it from an event
// published behind later ones of its aggregate (a fault run could not).
func TestWALReplayOfWhatTheStreamLostSaysWhereItWas(t *testing.T) {
	t.Parallel()
	const n = 30
	h := newWALHarness(t)
	h.cfg.Relay.Audit = false // the replay, not the auditor, publishes them again
	dying := h.newRelay(nil, nil)
	dying.wal.testHookBeforeConfirm = func(ctx context.Context, _ pglogrepl.LSN) {
		<-ctx.Done() // never confirm: the slot stays behind every event
	}
	h.start(dying)
	h.waitStreaming(dying)
	h.nats.Stop()
	snapshot, err := h.nats.Snapshot() // the stream, empty
	if err != nil {
		t.Fatal(err)
	}
	if err := h.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	writeMany(t, h.db.Pool, n)
	waitFor(t, 20*time.Second, "every event landed", func() (bool, string) {
		return h.streamCount() == n && h.landings() == n, fmt.Sprintf("%d in the stream, %d landings", h.streamCount(), h.landings())
	})
	landed := map[string]string{}
	for _, m := range h.streamMessages() {
		landed[m.Header.Get(wire.EventIDHeader)] = strconv.FormatUint(m.Sequence, 10)
	}
	stopCtx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_ = dying.Stop(stopCtx)

	h.nats.Stop()
	if err := h.nats.RollBack(snapshot); err != nil {
		t.Fatal(err)
	}
	if err := h.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	if got := h.streamCount(); got != 0 {
		t.Fatalf("after the rollback the stream holds %d events, want none: the test proves less than it claims", got)
	}
	obs := &auditCounter{}
	h.startRelay(nil, obs)
	h.waitAllSent(n, 30*time.Second)
	for _, m := range h.streamMessages() {
		id := m.Header.Get(wire.EventIDHeader)
		if got, want := m.Header.Get(wire.RepairedHeader), landed[id]; got != want {
			t.Errorf("event %s stored again at %d: %s %q, want %q (where it was lost from)", id, m.Sequence, wire.RepairedHeader, got, want)
		}
	}
	waitFor(t, 10*time.Second, "the repairs counted", func() (bool, string) {
		return obs.missing.Load() == n && obs.repaired.Load() == n, fmt.Sprintf("%d missing, %d repaired", obs.missing.Load(), obs.repaired.Load())
	})
	assertEachOnce(t, h, n)
}

// While NATS is down nothing gets a PubAck, and the slot must not move past
// what was decoded (the server's keepalives say it sent more): a relay
// killed then loses nothing, as the next relay decodes it all again.
func TestWALRelayKilledWhileNATSDownLosesNothing(t *testing.T) {
	t.Parallel()
	h := newWALHarness(t)
	rec := &recorder{}
	first := h.newRelay(func(c *Config) { c.PublishTimeout = 200 * time.Millisecond }, rec)
	first.wal.slotCheckEvery = 100 * time.Millisecond
	h.launch(first, func() { writeMany(t, h.db.Pool, 10) })
	h.waitAllSent(10, 10*time.Second)

	h.nats.Stop()
	writeMany(t, h.db.Pool, 200)
	// Long enough for several status intervals and server keepalives.
	waitFor(t, 20*time.Second, "the slot to be behind and stuck", func() (bool, string) {
		st := first.Slot()
		return st != nil && st.LagBytes > 0 && st.Stuck > 2*walStatusInterval, "not yet"
	})
	if err := first.Ready(); err != nil {
		t.Errorf("Ready before relay.stall_after: %v", err)
	}
	stopCtx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_ = first.Stop(stopCtx)

	if err := h.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	h.startRelay(nil, nil)
	h.waitAllSent(210, 30*time.Second)
	assertEachOnce(t, h, 210)
	if c := statusCounts(t, h.db.Pool); c["failed"] != 0 {
		t.Errorf("rows failed for an outage: %s", formatCounts(c))
	}
}

// A stuck slot turns readiness red after relay.stall_after, and green again
// once it moves; the lag is reported to the observer.
func TestWALStuckSlotIsNotReady(t *testing.T) {
	t.Parallel()
	h := newWALHarness(t)
	rec := &recorder{}
	r := h.newRelay(func(c *Config) {
		c.PublishTimeout = 200 * time.Millisecond
		c.StallAfter = 2 * time.Second
	}, rec)
	r.wal.slotCheckEvery = 100 * time.Millisecond
	h.launch(r, func() {})

	h.nats.Stop()
	writeMany(t, h.db.Pool, 20)
	waitFor(t, 20*time.Second, "readiness to report the stuck slot", func() (bool, string) {
		err := r.Ready()
		return err != nil && strings.Contains(err.Error(), "has not moved"), "ready"
	})
	rec.mu.Lock()
	lag := rec.lagBytes
	rec.mu.Unlock()
	if lag <= 0 {
		t.Errorf("observer saw slot lag %d bytes, want > 0", lag)
	}

	if err := h.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	h.waitAllSent(20, 30*time.Second)
	waitFor(t, 20*time.Second, "readiness back", func() (bool, string) {
		err := r.Ready()
		return err == nil, "still not ready"
	})
}

// Postgres lets one connection stream from a slot at a time: the second
// relay stands by and takes over within seconds when the first dies.
func TestWALStandbyTakesOver(t *testing.T) {
	t.Parallel()
	h := newWALHarness(t)
	a := h.newRelay(nil, nil)
	h.launch(a, func() { writeMany(t, h.db.Pool, 100) })
	h.waitAllSent(100, 10*time.Second)
	b := h.startRelay(nil, nil)
	waitFor(t, 10*time.Second, "the second relay to stand by", func() (bool, string) {
		return b.wal.state.Load() == captureStandby, "not standing by"
	})
	if err := b.Ready(); err != nil {
		t.Errorf("a standby relay is not ready: %v", err)
	}

	died := time.Now()
	// Cut short, as a kill would: its connection closes.
	stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	_ = a.Stop(stopCtx)
	writeMany(t, h.db.Pool, 100)
	h.waitStreaming(b)
	t.Logf("the standby streams %s after the first relay died", time.Since(died).Round(time.Millisecond))
	h.waitAllSent(200, 20*time.Second)
	assertEachOnce(t, h, 200)
}

// In wal capture the relay leaves the rows it published `pending`; the
// cleaner deletes them after relay.sent_retention, as it deletes sent rows.
func TestWALCapturedRowsDeletedAfterRetention(t *testing.T) {
	t.Parallel()
	h := newWALHarness(t)
	writeMany(t, h.db.Pool, 30) // the backlog, claimed and marked sent
	r := h.startRelay(func(c *Config) {
		c.SentRetention = 0
		c.CleanupInterval = 100 * time.Millisecond
	}, nil)
	h.waitStreaming(r)
	writeMany(t, h.db.Pool, 70)
	h.waitAllSent(100, 20*time.Second)
	waitFor(t, 20*time.Second, "the outbox to be empty", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return len(c) == 0, formatCounts(c)
	})
	assertEachOnce(t, h, 100)
}

// assertEachOnce checks that the stream holds events 1..n, each once.
func assertEachOnce(t *testing.T, h *harness, n int) {
	t.Helper()
	msgs := h.streamMessages()
	seen := map[string]int{}
	for _, m := range msgs {
		seen[m.Header.Get(wire.EventIDHeader)]++
	}
	for id, k := range seen {
		if k > 1 {
			t.Errorf("event %s stored %d times", id, k)
		}
	}
	if len(seen) != n || len(msgs) != n {
		t.Errorf("stream holds %d messages of %d events, want %d", len(msgs), len(seen), n)
	}
}

// A server shutting down waits for its walsenders' clients to confirm what
// they were sent, even in a fast shutdown. A wal relay that cannot publish
// (NATS down) must let go of its stream, or Postgres cannot stop; nothing
// is lost, as the events it had not confirmed are decoded again.
func TestWALRelayLetsPostgresStopWhileNATSDown(t *testing.T) {
	t.Parallel()
	server := pgtest.StartServer(t)
	h := newWALHarness(t)
	h.db = server.NewDB(t)
	r := h.newRelay(func(c *Config) { c.PublishTimeout = 200 * time.Millisecond }, nil)
	r.wal.slotCheckEvery = 100 * time.Millisecond
	h.launch(r, func() { writeMany(t, h.db.Pool, 10) })
	h.waitAllSent(10, 10*time.Second)

	h.nats.Stop()
	writeMany(t, h.db.Pool, 50)
	waitFor(t, 20*time.Second, "the slot to be behind and stuck", func() (bool, string) {
		st := r.Slot()
		return st != nil && st.LagBytes > 0 && st.Stuck > stuckAfter, "not yet"
	})
	// pg_ctl stop -m fast gives up after its 60 s timeout.
	if err := server.Stop(); err != nil {
		t.Fatalf("Postgres could not stop while the wal relay held its stream: %v", err)
	}
	if err := server.Start(); err != nil {
		t.Fatal(err)
	}
	if err := h.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	h.waitAllSent(60, 60*time.Second)
	assertEachOnce(t, h, 60)
}

// Switching capture modes on a running installation, under load, as a
// rolling deploy does: poll to wal with the relays of both modes running
// together for a while, and back. Every committed event is in the stream
// exactly once, the poll relay that takes over from the slot publishes
// again only the few the slot had not confirmed, and in the end every row
// is sent and the slot is gone.
func TestSwitchingCaptureUnderLoad(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	loadCtx, stopLoad := context.WithCancel(ctx)
	var committed atomic.Int64
	var loadErr atomic.Pointer[error]
	loadDone := make(chan struct{})
	go func() {
		defer close(loadDone)
		for i := 1; loadCtx.Err() == nil; i++ {
			err := pgx.BeginFunc(ctx, h.db.Pool, func(tx pgx.Tx) error {
				_, err := outbox.Write(ctx, tx, productEvent(i))
				return err
			})
			if err != nil {
				loadErr.Store(&err)
				return
			}
			committed.Add(1)
			time.Sleep(2 * time.Millisecond)
		}
	}()
	stopRelay := func(r *Relay) {
		t.Helper()
		stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := r.Stop(stopCtx); err != nil {
			t.Fatal(err)
		}
	}

	pollA := h.startRelay(nil, nil)
	time.Sleep(time.Second)
	h.cfg.Relay.Capture = CaptureWAL
	walRec := &recorder{}
	wal := h.startRelay(nil, walRec)
	h.waitStreaming(wal)
	time.Sleep(500 * time.Millisecond)
	stopRelay(pollA)
	time.Sleep(time.Second)

	h.cfg.Relay.Capture = CapturePoll
	rec := &recorder{}
	h.startRelay(nil, rec)
	time.Sleep(500 * time.Millisecond)
	if published, _ := rec.snapshot(); len(published) != 0 {
		t.Errorf("the poll relay published %d rows while a wal relay still streamed", len(published))
	}
	stopRelay(wal)
	time.Sleep(time.Second)
	stopLoad()
	<-loadDone
	if err := loadErr.Load(); err != nil {
		t.Fatal(*err)
	}
	n := int(committed.Load())
	waitFor(t, 30*time.Second, "every row sent", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return c["sent"] == n, formatCounts(c) + fmt.Sprintf(" of %d", n)
	})
	h.cfg.Relay.Capture = CaptureWAL // waitAllSent by the stream
	h.waitAllSent(n, 30*time.Second)
	assertEachOnce(t, h, n)

	// A wal relay stopped gracefully confirms all it published, and the
	// poll relay taking over marks those rows sent: it repeats none of
	// them. It may repeat rows it published itself (those committed after
	// its snapshot that its stream from the slot published too: how many
	// depends on the machine's speed, so they are only counted).
	walPublished := map[int64]bool{}
	walRows, _ := walRec.snapshot()
	for _, p := range walRows {
		walPublished[p.ID] = true
	}
	published, _ := rec.snapshot()
	var repeatedWAL []int64
	own := 0
	for _, p := range published {
		switch {
		case p.Duplicate && walPublished[p.ID]:
			repeatedWAL = append(repeatedWAL, p.ID)
		case p.Duplicate:
			own++
		}
	}
	t.Logf("%d events; the wal relay published %d; the poll relay taking over published %d, %d of them its own again", n, len(walRows), len(published), own)
	if len(walRows) == 0 {
		t.Error("the wal relay published nothing: the switch was not tried under load")
	}
	if len(repeatedWAL) > 0 {
		t.Errorf("the poll relay that took over from the slot published again %d events the wal relay had published and confirmed (the first: ids %v)", len(repeatedWAL), repeatedWAL[:min(len(repeatedWAL), 10)])
	}
	if _, _, exists, err := ReadSlot(ctx, h.db.Pool, h.db.Name); err != nil || exists {
		t.Errorf("the slot after the switch back: exists %t (%v)", exists, err)
	}
}

// The server invalidates a slot that holds more WAL than
// max_slot_wal_keep_size allows (here: the relay is down while writes go
// on, and their WAL is removed before any relay decodes it). The next relay
// drops the slot, creates it again, and publishes again every row the
// outbox still holds: the events the old slot never delivered among them,
// and JetStream drops the ones it already had.
func TestWALInvalidatedSlotIsRecovered(t *testing.T) {
	t.Parallel()
	server := pgtest.StartServer(t)
	h := newWALHarness(t)
	h.db = server.NewDB(t)
	ctx := context.Background()
	for _, sql := range []string{`ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'`, `SELECT pg_reload_conf()`} {
		if _, err := h.db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	first := h.newRelay(nil, nil)
	h.launch(first, func() { writeMany(t, h.db.Pool, 10) })
	h.waitAllSent(10, 10*time.Second)
	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := first.Stop(stopCtx); err != nil {
		t.Fatal(err)
	}

	writeMany(t, h.db.Pool, 100) // no relay runs: the slot holds their WAL
	if _, err := h.db.Pool.Exec(ctx, `CREATE TABLE filler AS SELECT g, repeat('x', 1000) AS pad FROM generate_series(1, 40000) AS g`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the server to invalidate the slot", func() (bool, string) {
		var status string
		_, _ = h.db.Pool.Exec(ctx, `SELECT pg_switch_wal()`)
		_, _ = h.db.Pool.Exec(ctx, `CHECKPOINT`)
		err := h.db.Pool.QueryRow(ctx, `SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1`, h.db.Name).Scan(&status)
		return err == nil && status == "lost", fmt.Sprintf("wal_status %q (%v)", status, err)
	})

	h.startRelay(nil, nil)
	h.waitAllSent(110, 60*time.Second)
	assertEachOnce(t, h, 110)
	st, _, ok, err := ReadSlot(ctx, h.db.Pool, h.db.Name)
	if err != nil || !ok || st.WALStatus == "lost" {
		t.Errorf("the slot after the recovery: %+v (exists %t, %v)", st, ok, err)
	}
}

// An outage holds a wal relay's publishes, and they are tried again at
// most outageWaitMax apart whatever relay.retry_max says: the slot waits
// for them, and everything behind them waits too, so a wait that doubled
// through the outage would hold the stream long after it ended. The same
// for relay.atomic transaction's batches.
func TestWALRetriesThroughAnOutageAtMostSecondsApart(t *testing.T) {
	t.Parallel()
	for _, atomic := range []string{AtomicEvent, AtomicTransaction} {
		t.Run(atomic, func(t *testing.T) {
			t.Parallel()
			h := newWALHarness(t)
			h.cfg.Relay.Atomic = atomic
			h.cfg.Relay.RetryMin = time.Second
			h.cfg.Relay.RetryMax = 5 * time.Minute
			var logs syncbuf.Buffer
			r := h.newRelay(nil, nil)
			r.logger = slog.New(slog.NewJSONHandler(&logs, nil))
			h.launch(r, func() { writeMany(t, h.db.Pool, 10) })
			h.waitAllSent(10, 10*time.Second)

			h.nats.Stop()
			writeMany(t, h.db.Pool, 20)
			// 1s, 2s, 4s, then the bound: 5s, however long the outage.
			waitFor(t, time.Minute, "two tries at the bound", func() (bool, string) {
				waits := retryWaits(t, logs.String())
				at := 0
				for _, w := range waits {
					if w == outageWaitMax {
						at++
					}
				}
				return at >= 2, fmt.Sprint(waits)
			})
			if err := h.nats.Restart(); err != nil {
				t.Fatal(err)
			}
			h.waitAllSent(30, 30*time.Second)
			assertEachOnce(t, h, 30)
			for _, w := range retryWaits(t, logs.String()) {
				if w > outageWaitMax {
					t.Errorf("a publish held by an outage waited %s before its next try (bound %s)", w, outageWaitMax)
				}
			}
		})
	}
}

// retryWaits are the waits before the next try that a relay's JSON log
// announced for publishes held by an outage.
func retryWaits(t *testing.T, logs string) []time.Duration {
	var waits []time.Duration
	for line := range strings.Lines(logs) {
		var entry struct {
			Msg     string        `json:"msg"`
			RetryIn time.Duration `json:"retry_in"`
		}
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Fatalf("relay log line %q: %v", line, err)
		}
		if strings.Contains(entry.Msg, "retrying, the slot waits") {
			waits = append(waits, entry.RetryIn)
		}
	}
	return waits
}
