package relay

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5/pgtype"
)

func TestNATSDownWhileWriting(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		r := h.newRelay(nil, nil)
		h.launch(r, func() { writeMany(t, h.db.Pool, 10) })
		h.waitAllSent(10, 10*time.Second)

		h.nats.Stop()
		writeMany(t, h.db.Pool, 200) // ids 11..210 in the table; product ids repeat, rows do not
		time.Sleep(500 * time.Millisecond)
		c := statusCounts(t, h.db.Pool)
		if c["failed"] != 0 {
			t.Fatalf("with NATS down: %s, want nothing failed", formatCounts(c))
		}
		if !h.wal() && (c["sent"] != 10 || c["pending"]+c["sending"] != 200) {
			t.Fatalf("with NATS down: %s, want 10 sent and 200 waiting", formatCounts(c))
		}

		if err := h.nats.Restart(); err != nil {
			t.Fatal(err)
		}
		h.waitAllSent(210, 30*time.Second)
		if got := len(h.streamMessages()); got != 210 {
			t.Fatalf("stream holds %d messages, want 210", got)
		}
	})
}

func TestPostgresRestartUnderRelay(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		server := pgtest.StartServer(t)
		h.db = server.NewDB(t)
		r := h.newRelay(nil, nil)
		h.launch(r, func() { writeMany(t, h.db.Pool, 100) })
		h.waitAllSent(100, 10*time.Second)
		if err := server.RestartImmediate(); err != nil {
			t.Fatal(err)
		}
		// The pool's connections died with the server; the first writes may
		// fail while it reconnects, as any application's would.
		waitFor(t, 20*time.Second, "a write after the restart", func() (bool, string) {
			_, err := h.db.Pool.Exec(context.Background(), "SELECT 1")
			return err == nil, "ping failed"
		})
		writeMany(t, h.db.Pool, 100)
		h.waitAllSent(200, 30*time.Second)
		if got := len(h.streamMessages()); got != 200 {
			t.Fatalf("stream holds %d messages, want 200", got)
		}
	})
}

func TestPoisonRowsFailWithoutBlockingOthers(t *testing.T) {
	forEachCapture(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		// Rows written behind the writer API's back (raw SQL, another
		// tool), each an aggregate of its own: a failed row holds only its
		// own aggregate's later events (TestFailedEventHoldsItsAggregate).
		insert := func(eventType, payload string) int64 {
			var id int64
			err := h.db.Pool.QueryRow(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('product', gen_random_uuid()::text, $1, `+payload+`) RETURNING id`, eventType).Scan(&id)
			if err != nil {
				t.Fatal(err)
			}
			return id
		}
		good := `'{"product_id": 1}'::jsonb`
		var goodIDs []int64
		var badSubject, wildcard, emptyToken, oversized int64
		h.launch(h.newRelay(nil, nil), func() {
			goodIDs = append(goodIDs, insert("product.updated", good))
			badSubject = insert("product updated", good)
			wildcard = insert("product.>", good)
			emptyToken = insert("product..updated", good)
			goodIDs = append(goodIDs, insert("product.updated", good))
			oversized = insert("product.updated", `jsonb_build_object('blob', repeat('x', 1100000))`)
			goodIDs = append(goodIDs, insert("product.updated", good))
		})

		waitFor(t, 15*time.Second, "3 published and 4 failed", func() (bool, string) {
			c := statusCounts(t, h.db.Pool)
			published := c["sent"]
			if h.wal() {
				published = h.streamCount()
			}
			return published == 3 && c["failed"] == 4, formatCounts(c) + fmt.Sprintf(" published=%d", published)
		})
		for id, want := range map[int64]string{
			badSubject: "event type",
			wildcard:   "event type",
			emptyToken: "event type",
			oversized:  "max_payload",
		} {
			var reason string
			if err := h.db.Pool.QueryRow(ctx, `SELECT last_error FROM outbox WHERE id = $1 AND status = 'failed'`, id).Scan(&reason); err != nil {
				t.Fatalf("row %d: %v", id, err)
			}
			if !strings.Contains(reason, want) {
				t.Errorf("row %d failed with %q, want a reason mentioning %q", id, reason, want)
			}
		}
		if got := len(h.streamMessages()); got != len(goodIDs) {
			t.Errorf("stream holds %d messages, want the %d good rows", got, len(goodIDs))
		}
	})
}

func TestStuckSendingRowIsReaped(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	writeMany(t, h.db.Pool, 5)
	// As a relay that claimed the rows and vanished an hour ago leaves them.
	if _, err := h.db.Pool.Exec(ctx, `UPDATE outbox SET status = 'sending', claimed_at = now() - interval '1 hour', lease_token = gen_random_uuid()`); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	h.startRelay(func(c *Config) { c.Lease = 5 * time.Second; c.ReapInterval = 50 * time.Millisecond }, rec)
	h.waitAllSent(5, 15*time.Second)
	if _, reaped := rec.snapshot(); reaped != 5 {
		t.Errorf("reaped %d rows, want 5", reaped)
	}
}

// A relay whose lease expired must not mark rows another relay has claimed
// since: only the holder of the current lease token records the outcome.
func TestStaleLeaseCannotMark(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	writeMany(t, h.db.Pool, 3)
	stale := h.newRelay(nil, nil)
	current := h.newRelay(nil, nil)

	staleToken := newLeaseToken()
	rows, _, err := stale.claim(ctx, staleToken)
	if err != nil || len(rows) != 3 {
		t.Fatalf("claim: %d rows, %v", len(rows), err)
	}
	// The stale relay's lease expires; the rows go back and are claimed anew.
	if _, err := h.db.Pool.Exec(ctx, `UPDATE outbox SET claimed_at = now() - interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	if _, err := outboxstore.New(h.db.Pool).Reap(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	currentToken := newLeaseToken()
	rows2, _, err := current.claim(ctx, currentToken)
	if err != nil || len(rows2) != 3 {
		t.Fatalf("second claim: %d rows, %v", len(rows2), err)
	}

	acked := []outcome{{acked: true, ackedAt: time.Now()}, {acked: true}, {permanent: true, err: "x"}}
	stale.delivery.record(ctx, rows, staleToken, acked, nil)
	if c := statusCounts(t, h.db.Pool); c["sending"] != 3 {
		t.Fatalf("after the stale relay recorded: %s, want all 3 still sending under the new lease", formatCounts(c))
	}
	current.delivery.record(ctx, rows2, currentToken, []outcome{{acked: true}, {acked: true}, {acked: true}}, nil)
	if c := statusCounts(t, h.db.Pool); c["sent"] != 3 {
		t.Fatalf("after the current relay recorded: %s, want 3 sent", formatCounts(c))
	}
	var token pgtype.UUID
	if err := h.db.Pool.QueryRow(ctx, `SELECT lease_token FROM outbox LIMIT 1`).Scan(&token); err != nil || token != currentToken {
		t.Errorf("lease token = %v, want the current relay's", token)
	}
}

func TestFailedPublishBacksOff(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	writeMany(t, h.db.Pool, 2)
	r := h.newRelay(nil, nil)
	token := newLeaseToken()
	rows, _, err := r.claim(ctx, token)
	if err != nil || len(rows) != 2 {
		t.Fatalf("claim: %d rows, %v", len(rows), err)
	}
	// available_at is computed from the recording transaction's start, so
	// the expected wait is bracketed by the clock before and after it.
	waitAfter := func(t *testing.T, outcomes []outcome, want time.Duration) (attempts int, lastError string) {
		t.Helper()
		var before, after, availableAt time.Time
		if err := h.db.Pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
			t.Fatal(err)
		}
		r.delivery.record(ctx, rows, token, outcomes, nil)
		if err := h.db.Pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&after); err != nil {
			t.Fatal(err)
		}
		err := h.db.Pool.QueryRow(ctx, `
SELECT attempts, last_error, available_at FROM outbox WHERE id = $1 AND status = 'pending'`, rows[0].ID).Scan(&attempts, &lastError, &availableAt)
		if err != nil {
			t.Fatal(err)
		}
		if availableAt.Before(before.Add(want)) || availableAt.After(after.Add(want)) {
			t.Errorf("available_at is %s after the recording started (which took %s), want %s",
				availableAt.Sub(before), after.Sub(before), want)
		}
		return attempts, lastError
	}
	// retry_min is 50ms in the harness: the first retry waits retry_min * 2^0.
	attempts, lastError := waitAfter(t, []outcome{{err: "nats: timeout"}, {err: "nats: timeout"}}, 50*time.Millisecond)
	if attempts != 1 || lastError != "nats: timeout" {
		t.Errorf("attempts %d, last_error %q; want 1 and the publish error", attempts, lastError)
	}
	// Claimed again after the backoff, a second failure doubles the wait.
	time.Sleep(60 * time.Millisecond)
	token = newLeaseToken()
	rows, _, err = r.claim(ctx, token)
	if err != nil || len(rows) != 2 {
		t.Fatalf("claim after backoff: %d rows, %v", len(rows), err)
	}
	if attempts, _ := waitAfter(t, []outcome{{err: "again"}, {err: "again"}}, 100*time.Millisecond); attempts != 2 {
		t.Errorf("after the second failure: attempts %d, want 2", attempts)
	}
}

func TestSentRowsDeletedAfterRetention(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	writeMany(t, h.db.Pool, 30)
	h.startRelay(func(c *Config) {
		c.SentRetention = 300 * time.Millisecond
		c.CleanupInterval = 100 * time.Millisecond
		c.CleanupBatch = 7 // several small deletes
	}, nil)
	waitFor(t, 15*time.Second, "sent rows deleted", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return len(c) == 0, formatCounts(c)
	})
	if got := len(h.streamMessages()); got != 30 {
		t.Errorf("stream holds %d messages, want 30", got)
	}
}

func TestGracefulStopFinishesBatchInFlight(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	writeMany(t, h.db.Pool, 50)
	release := make(chan struct{})
	inFlight := make(chan struct{}, 10)
	r := h.newRelay(nil, nil)
	r.delivery.testHookBeforeRecord = func(context.Context, []int64) {
		inFlight <- struct{}{}
		<-release
	}
	h.start(r)
	<-inFlight
	stopped := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		stopped <- r.Stop(ctx)
	}()
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while a batch was in flight", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("graceful Stop: %v", err)
	}
	if c := statusCounts(t, h.db.Pool); c["sent"] != 50 {
		t.Errorf("after graceful stop: %s, want the batch in flight recorded (50 sent)", formatCounts(c))
	}
}

// A relay whose max_in_flight is below its batch size would claim nothing
// and publish nothing while reporting itself started (reproduced before the
// fix: a row stayed pending with the relay running). It is refused, naming
// both keys.
func TestMaxInFlightBelowBatchSizeIsRefused(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	rc := h.cfg.Relay
	rc.MaxInFlight, rc.BatchSize = 600, 1000
	_, err := New(Options{Relay: rc, Stream: h.cfg.Stream, Pool: h.db.Pool, Conn: h.connect(), Logger: testLogger(t)})
	if err == nil || !strings.Contains(err.Error(), "relay.max_in_flight (600) must be at least relay.batch_size (1000)") {
		t.Fatalf("New with max_in_flight 600 and batch_size 1000: %v", err)
	}
}

// New checks the settings by relay.Config.Validate, as loading the
// configuration does: a relay embedded in another program, or given a
// Config not made from DefaultConfig, gets the same errors, each naming
// its key, before anything connects.
func TestNewRefusesInvalidSettings(t *testing.T) {
	t.Parallel()
	rc := DefaultConfig()
	rc.Capture, rc.PartitionSize = "", 10
	_, err := New(Options{Relay: rc})
	for _, key := range []string{"relay.capture", "relay.partition_size"} {
		if err == nil || !strings.Contains(err.Error(), key+" ") {
			t.Errorf("New with an empty capture and ranges of 10 ids: %v, want %s named", err, key)
		}
	}
}
