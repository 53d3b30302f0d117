package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
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

// slotLoop watches the slot: lag for the metrics and readiness, and a
// warning before the server would invalidate it.
func (r *Relay) slotLoop(ctx context.Context) {
	var (
		lastConfirmed string
		movedAt       = time.Now()
		warned        bool
	)
	t := time.NewTicker(r.slotCheckEvery)
	defer t.Stop()
	for {
		checkCtx, cancel := context.WithTimeout(ctx, max(r.slotCheckEvery, time.Second))
		st, confirmed, ok, err := ReadSlot(checkCtx, r.pool, r.cfg.Slot)
		cancel()
		switch {
		case err != nil:
			if ctx.Err() == nil {
				r.logger.Warn("read the replication slot's state", "error", err)
			}
		case !ok:
			r.slot.Store(nil)
		default:
			if confirmed != lastConfirmed || st.LagBytes == 0 {
				lastConfirmed, movedAt = confirmed, time.Now()
			}
			if st.LagBytes > 0 {
				st.Stuck = time.Since(movedAt)
			}
			r.slot.Store(&st)
			r.obs.SlotLag(st.LagBytes, st.Stuck)
			near := st.WALStatus == "unreserved" || (st.SafeWALBytes >= 0 && st.SafeWALBytes < st.LagBytes)
			if near && !warned {
				r.logger.Warn("the replication slot is near max_slot_wal_keep_size: if the server invalidates it, events must be republished",
					"slot", r.cfg.Slot, "lag_bytes", st.LagBytes, "safe_wal_bytes", st.SafeWALBytes, "wal_status", st.WALStatus)
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

// Slot returns the last state read of a wal relay's slot (nil before the
// first read, in poll capture, or when the slot does not exist).
func (r *Relay) Slot() *SlotState { return r.slot.Load() }

// walReady: a wal relay is ready while it streams or stands by for the
// slot, in contact with the server; it is not when the slot is behind and
// has not moved for relay.stall_after, or was invalidated.
func (r *Relay) walReady() error {
	since := time.Since(time.Unix(0, r.lastClaimed.Load()))
	if since > r.cfg.StallAfter {
		why := ""
		if last := r.lastClaimErr.Load(); last != nil {
			why = "; last error: " + *last
		}
		return fmt.Errorf("relay stalled: no contact with the replication slot %s for %s (relay.stall_after is %s)%s",
			r.cfg.Slot, since.Round(time.Second), r.cfg.StallAfter, why)
	}
	st := r.slot.Load()
	if st == nil {
		return nil
	}
	if st.WALStatus == "lost" {
		return fmt.Errorf("replication slot %s was invalidated by the server (max_slot_wal_keep_size)", r.cfg.Slot)
	}
	if r.captureState.Load() == captureStreaming && st.Stuck > r.cfg.StallAfter {
		return fmt.Errorf("relay stalled: replication slot %s is %d bytes behind and has not moved for %s (relay.stall_after is %s)",
			r.cfg.Slot, st.LagBytes, st.Stuck.Round(time.Second), r.cfg.StallAfter)
	}
	return nil
}
