package relay

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pglogrepl"
)

// Switching from wal capture back to poll.
//
// Rows a wal relay published stay `pending`, so a poll relay that simply
// started claiming would publish every one of them again. Before its first
// claim, a poll relay that finds its slot (relay.slot) takes over from the
// wal relays, one poll relay at a time (an advisory lock), once none of
// them streams any more:
//
//  1. it takes a snapshot S, then reads the WAL position L: every
//     transaction S shows committed before L;
//  2. it streams from the slot itself until it is confirmed past L, so
//     every transaction committed before L is published (what the wal
//     relays had not confirmed is published again, and JetStream drops
//     the duplicates);
//  3. it marks `sent` the pending rows S shows, above the slot's backlog
//     bound (rows at or below it were claimed, never captured), or all of
//     them once the backlog was published (one at or below the bound is
//     pending then only because an operator returned it, an update the
//     slot decoded);
//  4. it drops the slot and forgets it.
//
// Pending rows S does not show committed after S: the claim publishes them
// (those that committed before L too, as duplicates JetStream drops). A
// relay that dies midway leaves the slot, and the next poll relay starts
// over. The relay's role needs REPLICATION until the switch is done.

// handOver finishes the wal relays' work if the slot exists; it
// returns nil once there is no slot, and an error (to retry) otherwise.
func (w *walCapture) handOver(softCtx, hardCtx context.Context) error {
	_, _, exists, err := ReadSlot(softCtx, w.pool, w.cfg.Slot)
	if err != nil || !exists {
		return err
	}
	conn, err := w.pool.Acquire(softCtx)
	if err != nil {
		return err
	}
	defer conn.Release()
	h := fnv.New64a()
	h.Write([]byte("fanout relay handover " + w.cfg.Slot))
	lockID := int64(h.Sum64())
	var locked bool
	if err := conn.QueryRow(softCtx, `SELECT pg_try_advisory_lock($1)`, lockID).Scan(&locked); err != nil {
		return err
	}
	if !locked {
		return errHandoverBusy
	}
	defer conn.Exec(context.WithoutCancel(softCtx), `SELECT pg_advisory_unlock($1)`, lockID) //nolint:errcheck

	st, _, exists, err := ReadSlot(softCtx, conn, w.cfg.Slot)
	switch {
	case err != nil:
		return err
	case !exists:
		return nil // another poll relay finished the switch
	case st.Active:
		return errWALRelaysRunning
	case st.WALStatus == "lost":
		return fmt.Errorf("%w: slot %s has wal_status lost: it cannot be read to finish the switch to poll capture", errSlotLost, w.cfg.Slot)
	}
	through, backlogDone, recorded, err := w.store.ReadCapture(softCtx, w.cfg.Slot)
	if err != nil {
		return err
	}
	if !recorded {
		// No record of what was before the slot: nothing can be marked.
		return fmt.Errorf("replication slot %s has no relay_capture row: it is not a fanout relay's, or its relay died before recording its backlog; drop it by hand to switch to poll capture", w.cfg.Slot)
	}
	var snap, end string
	if err := conn.QueryRow(softCtx, `SELECT pg_current_snapshot()::text`).Scan(&snap); err != nil {
		return err
	}
	if err := conn.QueryRow(softCtx, `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
		return err
	}
	until, err := pglogrepl.ParseLSN(end)
	if err != nil {
		return err
	}
	w.logger.Info("switching from wal to poll capture: publishing what the slot still holds", "slot", w.cfg.Slot, "until", end)
	if err := w.streamSlot(softCtx, hardCtx, until); !errors.Is(err, errReachedUntil) {
		if err == nil {
			err = softCtx.Err()
		}
		return fmt.Errorf("stream the slot to %s: %w", end, err)
	}

	after := through
	if backlogDone {
		// Every row up to the bound was claimed and marked; one pending
		// now was returned to the relays since (outbox retry-failed,
		// republish), and the slot decoded that update.
		after = math.MinInt64
	}
	marked, err := w.store.MarkCapturedSent(softCtx, snap, after)
	if err != nil {
		return fmt.Errorf("mark the rows the slot published: %w", err)
	}
	if err := w.store.EndCapture(softCtx, w.cfg.Slot); err != nil {
		return fmt.Errorf("drop replication slot %s: %w", w.cfg.Slot, err)
	}
	w.logger.Info("switched from wal to poll capture: the slot is dropped", "slot", w.cfg.Slot, "rows_marked_sent", marked)
	return nil
}

var (
	errHandoverBusy     = errors.New("another poll relay is switching from wal capture")
	errWALRelaysRunning = errors.New("a wal relay still streams from the slot: stop the wal relays to finish the switch to poll capture")
)

// waitHandover runs handOver until it succeeds or ctx ends; the
// claim starts only then.
func (w *walCapture) waitHandover(softCtx, hardCtx context.Context) bool {
	wait := 100 * time.Millisecond
	var last string
	for softCtx.Err() == nil {
		err := w.handOver(softCtx, hardCtx)
		if err == nil {
			return true
		}
		w.touch() // waiting for the switch is not a stall
		if msg := err.Error(); msg != last {
			level := w.logger.Warn
			if errors.Is(err, errHandoverBusy) || errors.Is(err, errWALRelaysRunning) {
				level = w.logger.Info
			}
			level("poll capture waits before claiming", "slot", w.cfg.Slot, "reason", msg)
			last = msg
		}
		if !w.sleep(softCtx, wait) {
			return false
		}
		wait = min(wait*2, 2*time.Second)
	}
	return false
}

// Switching from poll to wal capture.
//
// Rows committed before the slot existed (a poll relay's backlog) are not
// in its stream. The relay that creates the slot records the highest id
// then visible (ensureSlot), and a wal relay publishes the rows up to it
// by claiming them, as a poll relay would, before it starts the stream
// (streamSlot, drainBacklog).

// drainBacklog claims and publishes the rows committed before the slot
// existed (b), then records that they are done. A relay that stops first
// leaves the record open; the next one drains again.
//
// With relay.atomic transaction the backlog goes by writer transactions,
// as a poll relay's claims take them (txDelivery.claimIn), and holds
// the transactions visible in the snapshot the bound was read in: one
// that was not commits after the slot existed, and the slot decodes it
// whole, so claiming its rows below the bound would publish it in parts.
// A record made before that snapshot was kept (migration 00023) has
// none: that backlog goes event by event.
func (w *walCapture) drainBacklog(ctx, hardCtx context.Context, b outboxstore.SlotBacklog) {
	if w.cfg.Atomic == AtomicTransaction && !w.hooks.BacklogByEvent {
		if b.Snapshot != "" {
			w.tx.claimIn(ctx, hardCtx, &b, func() bool { return w.backlogFinished(ctx, b) })
			return
		}
		w.logger.Warn("the slot's backlog was recorded before its snapshot was kept (migration 00023): its rows are published event by event, not as transactions",
			"slot", w.cfg.Slot, "through_id", b.Through)
	}
	b.Snapshot = "" // every row up to the bound, as the claim below takes them
	batch := int64(w.cfg.BatchSize)
	wait := w.cfg.PollInterval
	for ctx.Err() == nil {
		if w.backlogFinished(ctx, b) {
			return
		}
		if err := w.slots.Acquire(ctx, batch); err != nil {
			return
		}
		token := newLeaseToken()
		claimed, err := w.store.ClaimRows(hardCtx, outboxstore.RowsClaim{N: w.cfg.BatchSize, Token: token, After: math.MinInt64, Through: b.Through})
		rows := claimed.Claimed
		w.slots.Release(batch - int64(len(rows)))
		if err != nil || len(rows) == 0 {
			if err != nil {
				w.logger.Warn("claim rows committed before the slot", "error", err)
			}
			// Rows backing off, or `sending` under a dead poll relay's
			// lease (the reaper returns them).
			if !w.sleep(ctx, wait) {
				return
			}
			continue
		}
		sortRows(rows)
		w.batches.Add(1)
		func() {
			defer w.batches.Done()
			defer w.slots.Release(int64(len(rows)))
			// The rows after the bound are the slot's to publish: no
			// next event of an aggregate is claimed here.
			held := int64(len(rows))
			w.delivery.deliver(hardCtx, rows, token, false, &held)
		}()
	}
}

// backlogFinished records the slot's backlog b done if none of its rows is
// still to publish (marking those held behind a failed event first), and
// says whether it did.
func (w *walCapture) backlogFinished(ctx context.Context, b outboxstore.SlotBacklog) bool {
	left, err := w.store.UnsentThrough(ctx, b.Through, b.Snapshot)
	if err == nil && left == 0 && w.store.OnFailed != outboxstore.SkipFailed {
		_, err = w.store.MarkHeldThrough(ctx, b.Through, b.Snapshot)
	}
	if err == nil && left == 0 {
		err = w.store.CaptureBacklogDone(ctx, w.cfg.Slot, b.Through)
		if err == nil {
			w.backlogDone.Store(true)
			w.logger.Info("published the rows committed before the slot existed", "through_id", b.Through, "by_transaction", b.Snapshot != "")
			return true
		}
	}
	if err != nil && ctx.Err() == nil {
		w.logger.Warn("drain the rows committed before the slot", "error", err)
	}
	return false
}
