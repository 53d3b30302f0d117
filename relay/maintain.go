package relay

import (
	"context"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
)

// reapSQL returns rows whose lease expired to `pending`. Their relay died or
// stalled after claiming them; whether it published them or not, publishing
// again is safe (JetStream drops the duplicate within its window).
const reapSQL = `
WITH expired AS (
    SELECT id
    FROM outbox
    WHERE published_at IS NULL AND status = 'sending' AND claimed_at < now() - make_interval(secs => $1::float8)
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET status = 'pending', claimed_at = NULL, lease_token = NULL,
    last_error = 'lease expired: its relay died or stalled before recording the publish'
FROM expired
WHERE o.id = expired.id`

func (r *Relay) reapLoop(ctx context.Context) {
	r.every(ctx, r.cfg.ReapInterval, "reap expired leases", func(ctx context.Context) (int64, error) {
		ct, err := r.pool.Exec(ctx, reapSQL, r.cfg.Lease.Seconds())
		if err != nil {
			return 0, err
		}
		if n := ct.RowsAffected(); n > 0 {
			r.obs.Reaped(int(n))
			r.logger.Warn("reaped rows whose lease expired", "rows", n, "lease", r.cfg.Lease)
			r.Nudge()
		}
		return ct.RowsAffected(), nil
	})
}

// cleanupSQL deletes one small batch of sent rows past their retention;
// small batches keep each transaction short and the table from bloating.
// Old sent rows hold the lowest ids, so the walk up the primary key finds
// them first (there is no index on status = 'sent': see the schema).
const cleanupSQL = `
DELETE FROM outbox
WHERE id IN (
    SELECT id
    FROM outbox
    WHERE status = 'sent' AND published_at < now() - make_interval(secs => $1::float8)
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)`

func (r *Relay) cleanupLoop(ctx context.Context) {
	r.every(ctx, r.cfg.CleanupInterval, "delete sent rows past retention", func(ctx context.Context) (int64, error) {
		var total int64
		for ctx.Err() == nil {
			ct, err := r.pool.Exec(ctx, cleanupSQL, r.cfg.SentRetention.Seconds(), r.cfg.CleanupBatch)
			if err != nil {
				return total, err
			}
			total += ct.RowsAffected()
			r.obs.Deleted(int(ct.RowsAffected()))
			if ct.RowsAffected() < int64(r.cfg.CleanupBatch) {
				break
			}
		}
		if total > 0 {
			r.logger.Debug("deleted sent rows", "rows", total, "retention", r.cfg.SentRetention)
		}
		return total, nil
	})
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
