package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SlotState is what the server says of a wal relay's replication slot.
type SlotState struct {
	Name      string
	Active    bool   // a relay streams from it now
	WALStatus string // reserved, extended, unreserved or lost
	// LagBytes is how far the confirmed position is behind the server's
	// current WAL position.
	LagBytes int64
	// SafeWALBytes is how much more WAL may be written before the server
	// invalidates the slot (max_slot_wal_keep_size); -1 when unlimited.
	SafeWALBytes int64
	// Stuck is how long the slot has been behind without its confirmed
	// position moving (0 when it is not behind).
	Stuck     time.Duration
	CheckedAt time.Time
}

// slotCheckInterval is how often a wal relay reads its slot's state.
const slotCheckInterval = 5 * time.Second

// ReadSlot reads the state of a replication slot of the current database;
// ok is false if there is none of that name.
func ReadSlot(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, slot string) (st SlotState, confirmed string, ok bool, err error) {
	var safe *int64
	err = q.QueryRow(ctx, `
SELECT active, coalesce(wal_status, ''),
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::bigint,
       safe_wal_size, coalesce(confirmed_flush_lsn::text, '')
FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`, slot).Scan(&st.Active, &st.WALStatus, &st.LagBytes, &safe, &confirmed)
	if errors.Is(err, pgx.ErrNoRows) {
		return SlotState{Name: slot}, "", false, nil
	}
	if err != nil {
		return SlotState{}, "", false, fmt.Errorf("read replication slot %s: %w", slot, err)
	}
	st.Name = slot
	st.SafeWALBytes = -1
	if safe != nil {
		st.SafeWALBytes = *safe
	}
	st.CheckedAt = time.Now()
	return st, confirmed, true, nil
}

// watchSlot watches the slot: lag for the metrics and readiness, and a
// warning before the server would invalidate it.
func (w *walCapture) watchSlot(ctx context.Context) {
	var (
		lastConfirmed string
		movedAt       = time.Now()
		warned        bool
	)
	t := time.NewTicker(w.slotCheckEvery)
	defer t.Stop()
	for {
		checkCtx, cancel := context.WithTimeout(ctx, max(w.slotCheckEvery, time.Second))
		st, confirmed, ok, err := ReadSlot(checkCtx, w.pool, w.cfg.Slot)
		cancel()
		switch {
		case err != nil:
			if ctx.Err() == nil {
				w.logger.Warn("read the replication slot's state", "error", err)
			}
		case !ok:
			w.slot.Store(nil)
		default:
			if confirmed != lastConfirmed || st.LagBytes == 0 {
				lastConfirmed, movedAt = confirmed, time.Now()
			}
			if st.LagBytes > 0 {
				st.Stuck = time.Since(movedAt)
			}
			w.slot.Store(&st)
			w.obs.SlotLag(st.LagBytes, st.Stuck)
			near := st.WALStatus == "unreserved" || (st.SafeWALBytes >= 0 && st.SafeWALBytes < st.LagBytes)
			if near && !warned {
				w.logger.Warn("the replication slot is near max_slot_wal_keep_size: if the server invalidates it, events must be republished",
					"slot", w.cfg.Slot, "lag_bytes", st.LagBytes, "safe_wal_bytes", st.SafeWALBytes, "wal_status", st.WALStatus)
			}
			warned = near
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// ready: a wal relay is ready while it streams or stands by for the
// slot, in contact with the server; it is not when the slot is behind and
// has not moved for relay.stall_after, or was invalidated.
func (w *walCapture) ready() error {
	since := time.Since(time.Unix(0, w.lastClaimed.Load()))
	if since > w.cfg.StallAfter {
		why := ""
		if last := w.lastClaimErr.Load(); last != nil {
			why = "; last error: " + *last
		}
		return fmt.Errorf("relay stalled: no contact with the replication slot %s for %s (relay.stall_after is %s)%s",
			w.cfg.Slot, since.Round(time.Second), w.cfg.StallAfter, why)
	}
	st := w.slot.Load()
	if st == nil {
		return nil
	}
	if st.WALStatus == "lost" {
		return fmt.Errorf("replication slot %s was invalidated by the server (max_slot_wal_keep_size)", w.cfg.Slot)
	}
	if w.state.Load() == captureStreaming && st.Stuck > w.cfg.StallAfter {
		return fmt.Errorf("relay stalled: replication slot %s is %d bytes behind and has not moved for %s (relay.stall_after is %s)",
			w.cfg.Slot, st.LagBytes, st.Stuck.Round(time.Second), w.cfg.StallAfter)
	}
	return nil
}

// errSlotLost: the server invalidated the slot (max_slot_wal_keep_size);
// the WAL it needed is gone.
var errSlotLost = errors.New("replication slot invalidated")

// ensureSlot creates the slot if it does not exist and returns the bound of
// the rows it does not capture (those committed before it), and whether
// they have all been published.
func (w *walCapture) ensureSlot(ctx context.Context, conn *pgconn.PgConn, create bool) (backlog outboxstore.SlotBacklog, err error) {
	var (
		plugin, walStatus string
		database          string
		found             bool
	)
	err = w.pool.QueryRow(ctx, `
SELECT plugin, coalesce(database, ''), coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1`, w.cfg.Slot).
		Scan(&plugin, &database, &walStatus)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return backlog, fmt.Errorf("look up replication slot %s: %w", w.cfg.Slot, err)
	default:
		found = true
	}
	if found {
		var current string
		if err := w.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&current); err != nil {
			return backlog, err
		}
		if plugin != "pgoutput" || database != current {
			return backlog, fmt.Errorf("replication slot %s exists but is not fanout's (plugin %q, database %q; want pgoutput on %q): set relay.slot to another name", w.cfg.Slot, plugin, database, current)
		}
		if walStatus == "lost" {
			if !create {
				return backlog, fmt.Errorf("%w: slot %s has wal_status lost", errSlotLost, w.cfg.Slot)
			}
			if err := w.recoverLostSlot(ctx); err != nil {
				return backlog, err
			}
			found = false
		}
	}
	if !found && !create {
		return backlog, fmt.Errorf("replication slot %s is gone", w.cfg.Slot)
	}
	if !found {
		createCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		res, err := pglogrepl.CreateReplicationSlot(createCtx, conn, w.cfg.Slot, "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{SnapshotAction: "NOEXPORT_SNAPSHOT", Mode: pglogrepl.LogicalReplication})
		cancel()
		if err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42710" { // another relay created it a moment ago
				return backlog, fmt.Errorf("%w: %s", errSlotInUse, pgErr.Message)
			}
			return backlog, fmt.Errorf("create replication slot %s: %w", w.cfg.Slot, err)
		}
		w.logger.Info("created the replication slot", "slot", res.SlotName, "consistent_point", res.ConsistentPoint)
		if err := w.store.StartCapture(ctx, w.cfg.Slot); err != nil {
			return backlog, fmt.Errorf("record the slot's backlog: %w", err)
		}
	}
	// Recorded now if the relay that created the slot died first.
	backlog, err = w.store.CaptureBacklog(ctx, w.cfg.Slot)
	if err != nil {
		return backlog, fmt.Errorf("read the slot's backlog: %w", err)
	}
	w.backlogThrough.Store(backlog.Through)
	w.backlogDone.Store(backlog.Done)
	return backlog, nil
}

// recoverLostSlot drops a slot the server invalidated (it removed WAL the
// slot still needed, past max_slot_wal_keep_size), so that ensureSlot
// creates it again. The new slot's backlog bound then covers every row the
// outbox still holds, and the drain claims and publishes them all again:
// the events the old slot never delivered among them. JetStream drops
// those inside its duplicates window, the subscribers' checkpoints the
// rest. Events whose rows retention already deleted cannot be recovered;
// the log names the range that is.
func (w *walCapture) recoverLostSlot(ctx context.Context) error {
	lo, hi, oldest, err := w.store.PendingSpan(ctx)
	if err != nil {
		return fmt.Errorf("read the outbox to recover invalidated slot %s: %w", w.cfg.Slot, err)
	}
	if _, err := w.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, w.cfg.Slot); err != nil {
		return fmt.Errorf("drop invalidated replication slot %s: %w", w.cfg.Slot, err)
	}
	w.logger.Error("the server invalidated the replication slot (max_slot_wal_keep_size): it is dropped and created again, "+
		"and every pending row the outbox still holds is published again; events whose rows retention deleted before they were published are lost",
		"slot", w.cfg.Slot, "republish_from_id", lo, "republish_to_id", hi, "oldest_row_created_at", oldest)
	return nil
}
