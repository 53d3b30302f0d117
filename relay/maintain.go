package relay

import (
	"context"
	"math"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
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

// cleanupLoop deletes sent rows past their retention in small batches:
// each transaction stays short and the table does not bloat.
func (r *Relay) cleanupLoop(ctx context.Context) {
	r.every(ctx, r.cfg.CleanupInterval, "delete sent rows past retention", func(ctx context.Context) (int64, error) {
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
			r.logger.Debug("deleted sent rows", "rows", total, "retention", r.cfg.SentRetention)
		}
		return total, nil
	})
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
