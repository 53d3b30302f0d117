package relay

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/nats-io/nats.go/jetstream"
)

// distinctEvents counts the distinct events (Nats-Msg-Id) the stream holds.
func (h *harness) distinctEvents() int {
	h.t.Helper()
	seen := map[string]bool{}
	for _, m := range h.streamMessages() {
		seen[m.Header.Get(jetstream.MsgIDHeader)] = true
	}
	return len(seen)
}

// landings is how many events have a landing recorded.
func (h *harness) landings() int {
	h.t.Helper()
	var n int
	if err := h.db.Pool.QueryRow(context.Background(), `SELECT coalesce(sum(cardinality(event_ids)), 0) FROM outbox_landings`).Scan(&n); err != nil {
		h.t.Fatal(err)
	}
	return n
}

// The stream loses events it acknowledged: nats-server's store is rolled
// back to a copy taken earlier, as a disk that lost its last writes would
// leave it. The auditor finds every lost event (the relay's reconnect is
// the sign) and publishes it again from its row; without an auditor (the
// sabotage hook NoAudit) they stay lost. A lookback the stream does not
// answer at first (a cluster electing its leader after the loss) is tried
// again until it finishes: the sign is not seen twice.
func TestAuditRepublishesWhatTheStreamLost(t *testing.T) {
	t.Parallel()
	const kept, lost = 20, 30
	for _, capture := range []string{CapturePoll, CaptureWAL} {
		for _, variant := range []string{"", "sabotage", "lookback-fails"} {
			sabotage := variant == "sabotage"
			name := capture
			if variant != "" {
				name += "/" + variant
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				h := newHarness(t)
				h.cfg.Relay.Capture = capture
				h.cfg.Relay.AuditInterval = 100 * time.Millisecond
				h.cfg.Relay.AuditDelay = 0
				h.cfg.Relay.AuditLookback = time.Minute
				obs := &auditCounter{}
				r := h.newRelay(nil, obs)
				r.hooks = testhooks.Relay{NoAudit: sabotage}
				var rolledBack atomic.Bool
				var failedLookbacks atomic.Int32
				if variant == "lookback-fails" {
					// The first two lookbacks after the rollback fail.
					r.hooks.FailLookback = func() bool {
						return rolledBack.Load() && failedLookbacks.Add(1) <= 2
					}
				}
				r.auditor.consumerRead = 1 // every run through the audit's consumer
				h.launch(r, func() { writeMany(t, h.db.Pool, kept) })
				waitFor(t, 20*time.Second, "the first events landed", func() (bool, string) {
					return h.streamCount() == kept && h.landings() == kept, fmt.Sprintf("%d in the stream, %d landings", h.streamCount(), h.landings())
				})

				h.nats.Stop()
				snapshot, err := h.nats.Snapshot()
				if err != nil {
					t.Fatal(err)
				}
				if err := h.nats.Restart(); err != nil {
					t.Fatal(err)
				}
				writeMany(t, h.db.Pool, lost)
				waitFor(t, 20*time.Second, "every event landed", func() (bool, string) {
					return h.distinctEvents() == kept+lost && h.landings() >= kept+lost,
						fmt.Sprintf("%d in the stream, %d landings", h.distinctEvents(), h.landings())
				})
				if variant == "lookback-fails" {
					// The tail has checked every landing: only a lookback
					// finds what the rollback takes away.
					waitFor(t, 20*time.Second, "the tail audit past every landing", func() (bool, string) {
						var tail, last int64
						if err := h.db.Pool.QueryRow(context.Background(), `SELECT (SELECT tail_landing FROM outbox_audit_state), (SELECT coalesce(max(id), 0) FROM outbox_landings)`).Scan(&tail, &last); err != nil {
							t.Fatal(err)
						}
						return tail >= last, fmt.Sprintf("tail at landing %d of %d", tail, last)
					})
				}
				h.nats.Stop()
				rolledBack.Store(true)
				if err := h.nats.RollBack(snapshot); err != nil {
					t.Fatal(err)
				}
				if err := h.nats.Restart(); err != nil {
					t.Fatal(err)
				}
				if got := h.streamCount(); got != kept {
					t.Fatalf("after the rollback the stream holds %d events, want the %d of the snapshot: the test proves less than it claims", got, kept)
				}

				if sabotage {
					time.Sleep(3 * time.Second) // a dozen audit intervals
					if got := h.distinctEvents(); got != kept {
						t.Fatalf("sabotaged (no auditor): the stream holds %d events, want the %d left by the rollback", got, kept)
					}
					t.Logf("sabotaged: %d acknowledged events stay lost", lost)
					return
				}
				// The audit reports once its repairs are recorded, a moment
				// after they are in the stream.
				waitFor(t, 30*time.Second, "the lost events published again, and the audit's report", func() (bool, string) {
					got := h.distinctEvents()
					m, rep := obs.missing.Load(), obs.repaired.Load()
					return got == kept+lost && m >= lost && rep >= lost,
						fmt.Sprintf("%d distinct events in the stream; the audits counted %d missing, %d repaired", got, m, rep)
				})
				if variant == "lookback-fails" && failedLookbacks.Load() < 3 {
					t.Fatalf("the lookback was tried %d times after the rollback: the test proves less than it claims", failedLookbacks.Load())
				}
				audits, err := outboxstore.New(h.db.Pool).Audits(context.Background())
				if err != nil || len(audits) == 0 {
					t.Fatalf("audits recorded: %v (%v)", audits, err)
				}
				t.Logf("audits: %+v", audits)
			})
		}
	}
}

// auditCounter counts what the audits report.
type auditCounter struct {
	NopObserver
	missing, repaired, altered atomic.Int64
}

func (c *auditCounter) AuditAltered(_ string, n int) { c.altered.Add(int64(n)) }

func (c *auditCounter) Audited(_ string, _, missing, repaired int) {
	c.missing.Add(int64(missing))
	c.repaired.Add(int64(repaired))
}

// A range of the outbox is dropped only after an audit of it passed: not
// while no auditor runs, and not by an audit that found events missing
// (here: published with no landing recorded, as by a relay that died
// between its PubAcks and its record, or before landings were recorded),
// which publishes them again and audits the range once more.
func TestARangeIsDroppedOnlyAfterItsAuditPassed(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	ranges := func() int {
		var n int
		if err := h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_partitions WHERE upper_id <= 31`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	a := smallRanges(h.newRelay(nil, nil))
	a.hooks = testhooks.Relay{NoAudit: true}
	h.start(a)
	waitFor(t, 10*time.Second, "the first ranges", func() (bool, string) { return ranges() == 2, fmt.Sprint(ranges()) })
	writeProductsByTen(t, h, 40)
	// Ids 1..10 land in outbox_default (the margin), whose rows are
	// deleted one by one: the ranges hold 11..40.
	waitFor(t, 20*time.Second, "40 events in the stream", func() (bool, string) { return h.streamCount() == 40, fmt.Sprint(h.streamCount()) })
	time.Sleep(time.Second) // ten retention passes
	if n := ranges(); n != 2 {
		t.Fatalf("%d of the ranges [11, 21) and [21, 31) left, want both: no auditor ran", n)
	}
	// Rows 11..15 published with no landing recorded.
	if _, err := h.db.Pool.Exec(ctx, `
UPDATE outbox_landings SET event_ids = e.ids, seqs = e.seqs, first_id = e.ids[1], last_id = e.ids[cardinality(e.ids)]
FROM (SELECT l.id, array_agg(u.i ORDER BY u.i) AS ids, array_agg(u.s ORDER BY u.i) AS seqs
      FROM outbox_landings l, unnest(l.event_ids, l.seqs) AS u(i, s) WHERE u.i NOT BETWEEN 11 AND 15 GROUP BY l.id) e
WHERE outbox_landings.id = e.id`); err != nil {
		t.Fatal(err)
	}
	stop, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := a.Stop(stop); err != nil {
		t.Fatal(err)
	}

	obs := &auditCounter{}
	h.start(smallRanges(h.newRelay(nil, obs)))
	waitFor(t, 30*time.Second, "both ranges dropped", func() (bool, string) { return ranges() == 0, fmt.Sprint(ranges(), " left") })
	if m := obs.missing.Load(); m < 5 {
		t.Fatalf("the audits found %d events missing, want the 5 with no landing", m)
	}
	var passed int
	if err := h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_audits WHERE kind = 'range' AND missing = 0`).Scan(&passed); err != nil || passed < 2 {
		t.Fatalf("%d clean range audits recorded (%v), want one per range dropped", passed, err)
	}
	if got := h.distinctEvents(); got != 40 {
		t.Fatalf("%d distinct events in the stream, want 40", got)
	}
}

// smallRanges sets r to ranges of 10 ids, dropped as soon as their audit
// passes (retention 0, a pass every 100 ms).
func smallRanges(r *Relay) *Relay {
	r.cfg.SentRetention, r.cfg.CleanupInterval = 0, 100*time.Millisecond
	r.cfg.PartitionSize, r.maintainer.partitionsAhead, r.maintainer.partitionMargin = 10, 10, 10
	return r
}

// writeProductsByTen commits n product events (1..n), ten a transaction.
func writeProductsByTen(t *testing.T, h *harness, n int) {
	t.Helper()
	for i := 0; i < n; i += 10 {
		events := make([]outbox.Event, min(10, n-i))
		for j := range events {
			events[j] = productEvent(i + j + 1)
		}
		write(t, h.db.Pool, events...)
	}
}
