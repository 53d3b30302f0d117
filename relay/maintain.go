package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func (r *Relay) reapLoop(ctx context.Context) {
	r.every(ctx, r.cfg.ReapInterval, "reap expired leases", func(ctx context.Context) (int64, error) {
		n, err := r.store.Reap(ctx, r.cfg.Lease)
		if err != nil {
			return 0, err
		}
		if n > 0 {
			r.obs.Reaped(int(n))
			r.logger.Warn("reaped rows whose lease expired", "rows", n, "lease", r.cfg.Lease)
			r.Nudge()
		}
		return n, nil
	})
}

// defaultPartitionsAhead is how many empty ranges the outbox keeps beyond
// the next id: at the defaults, two million ids, over half an hour of
// writes at 1000/s between two passes a minute apart. Ids that outrun the
// ranges still land somewhere: in outbox_default.
const defaultPartitionsAhead = 2

// The partition margin is how far above the next id a range starts when
// the ids have caught up with the ranges (fanout_outbox_extend): writers
// would have to take this many ids in the few milliseconds the range takes
// to attach (at most 200 ms waiting for its lock) to collide with it. One
// range's worth, within these bounds.
const (
	minPartitionMargin = 1_000
	maxPartitionMargin = 100_000
)

// cleanupLoop is the outbox's retention (see the schema, migration 00008):
// it adds ranges ahead of the ids, seals the full ones and drops whole
// ranges past retention, then deletes the few rows of outbox_default past
// theirs, in small batches.
func (r *Relay) cleanupLoop(ctx context.Context) {
	r.every(ctx, r.cfg.CleanupInterval, "outbox retention", func(ctx context.Context) (int64, error) {
		if err := r.keepRanges(ctx); err != nil && ctx.Err() == nil {
			// A lock not granted within the functions' lock_timeout
			// (writers, claims or a held snapshot in the way) is tried
			// again at the next pass.
			level := slog.LevelWarn
			if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
				level = slog.LevelInfo
			}
			r.logger.Log(ctx, level, "outbox ranges: will try again at the next pass", "error", err, "next_pass_in", r.cfg.CleanupInterval)
		}
		total, err := r.deleteInBatches(ctx, func(ctx context.Context) (int64, error) {
			return r.store.DeleteSent(ctx, r.cfg.SentRetention, r.cfg.CleanupBatch)
		})
		if err != nil {
			return total, err
		}
		// A wal relay leaves the rows it captured `pending`; once the
		// slot's backlog bound is known, those past retention go too.
		// Not while the slot is stuck: a row the slot has not delivered
		// is what an invalidated slot would be recovered from.
		stuck := false
		if st := r.slot.Load(); st != nil && (st.Stuck > r.cfg.StallAfter || st.WALStatus == "lost") {
			stuck = true
		}
		if through := r.backlogThrough.Load(); r.cfg.Capture == CaptureWAL && through >= 0 && !stuck {
			if r.backlogDone.Load() {
				// A row up to the bound pending now was returned to the
				// relays since (outbox retry-failed, republish), and the
				// slot decoded that update.
				through = math.MinInt64
			}
			n, err := r.deleteInBatches(ctx, func(ctx context.Context) (int64, error) {
				return r.store.DeleteCaptured(ctx, r.cfg.SentRetention, r.cfg.CleanupBatch, through)
			})
			total += n
			if err != nil {
				return total, err
			}
		}
		if total > 0 {
			r.logger.Debug("deleted rows of outbox_default", "rows", total, "retention", r.cfg.SentRetention)
		}
		return total, nil
	})
}

// keepRanges adds the outbox's ranges ahead of the ids, seals the full
// ones, and drops the sealed ones whose rows were all published longer
// than relay.sent_retention ago. The database decides each step under its
// locks (fanout_outbox_extend, _seal, _retire); the relay only asks.
func (r *Relay) keepRanges(ctx context.Context) error {
	added, err := r.store.ExtendPartitions(ctx, r.cfg.PartitionSize, r.partitionsAhead, r.partitionMargin)
	if err != nil {
		return fmt.Errorf("add ranges: %w", err)
	}
	if len(added) > 0 {
		r.logger.Info("added outbox ranges", "ranges", added, "ids_each", r.cfg.PartitionSize)
	}
	ranges, err := r.store.Partitions(ctx)
	if err != nil {
		return fmt.Errorf("list ranges: %w", err)
	}
	retire, canRetire, err := r.retirement(ctx)
	if err != nil {
		return err
	}
	dropped := 0
	defer func() { r.obs.OutboxRanges(len(ranges)-dropped, dropped) }()
	for _, p := range ranges {
		if p.SealedAt == nil {
			sealed, err := r.store.SealPartition(ctx, p.Name)
			if err != nil {
				return fmt.Errorf("seal range %s: %w", p.Name, err)
			}
			if !sealed {
				break // its ids are not all handed out, nor those of the ranges above it
			}
			r.logger.Debug("sealed an outbox range", "range", p.Name)
			continue // retention counts from now
		}
		if !canRetire || time.Since(*p.SealedAt) < r.cfg.SentRetention {
			continue
		}
		ok, moved, reason, err := r.store.RetirePartition(ctx, p.Name, retire)
		if err != nil {
			return fmt.Errorf("drop range %s: %w", p.Name, err)
		}
		if !ok {
			r.logger.Debug("outbox range kept", "range", p.Name, "reason", reason)
			continue
		}
		dropped++
		r.logger.Info("dropped an outbox range past retention", "range", p.Name, "failed_rows_moved_to_outbox_default", moved)
	}
	return nil
}

// retirement says what a range must meet to be dropped; ok is false when
// this relay cannot tell (a wal relay that has not yet opened its slot:
// the one that streams drops the ranges).
func (r *Relay) retirement(ctx context.Context) (ret outbox.Retirement, ok bool, err error) {
	ret = outbox.Retirement{Retention: r.cfg.SentRetention, BacklogThrough: math.MinInt64, RequireAudit: r.cfg.Audit}
	if r.cfg.Capture != CaptureWAL {
		return ret, true, nil
	}
	ret.Captured = true
	through := r.backlogThrough.Load()
	if through < 0 {
		return ret, false, nil
	}
	if !r.backlogDone.Load() {
		ret.BacklogThrough = through
	}
	_, confirmed, exists, err := ReadSlot(ctx, r.pool, r.cfg.Slot)
	if err != nil || !exists {
		return ret, false, err
	}
	ret.ConfirmedLSN = confirmed
	return ret, confirmed != "", nil
}

// deleteInBatches runs del, which deletes up to relay.cleanup_batch rows,
// until it deletes fewer, and returns how many it deleted in all.
func (r *Relay) deleteInBatches(ctx context.Context, del func(context.Context) (int64, error)) (int64, error) {
	var total int64
	for ctx.Err() == nil {
		n, err := del(ctx)
		if err != nil {
			return total, err
		}
		total += n
		r.obs.Deleted(int(n))
		if n < int64(r.cfg.CleanupBatch) {
			break
		}
	}
	return total, nil
}

// every runs job now and then every interval until ctx ends, logging errors.
func (r *Relay) every(ctx context.Context, interval time.Duration, what string, job func(context.Context) (int64, error)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := job(ctx); err != nil && ctx.Err() == nil {
			r.logger.Error(what, "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// listen holds a dedicated connection LISTENing for writers' wake-ups, and
// reconnects when it breaks. Every (re)connect also nudges the claimer,
// since rows may have committed while nobody listened.
func (r *Relay) listen(ctx context.Context) {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := r.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		r.logger.Warn("wake-up listener lost its connection; polling covers the gap", "error", err, "reconnect_in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(wait*2, 5*time.Second)
	}
}

func (r *Relay) listenOnce(ctx context.Context) error {
	cc := r.pool.Config().ConnConfig.Copy()
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{outbox.WakeChannel}.Sanitize()); err != nil {
		return err
	}
	r.Nudge()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		r.Nudge()
	}
}
