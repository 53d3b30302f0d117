package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pgx/v5/pgconn"
)

// maintainer keeps the outbox: it reaps the leases of relays that died
// (reap), and keeps its ranges, adding them ahead of the ids, sealing the
// full ones and dropping those past retention (cleanup, migration 00008).
type maintainer struct {
	*core
	wal *walCapture // its slot and backlog say what a wal relay may drop
	// partitionsAhead is how many empty ranges the outbox keeps beyond
	// the next id (defaultPartitionsAhead); tests with small ranges raise it.
	partitionsAhead int
	partitionMargin int64 // see maxPartitionMargin; tests lower it
}

func newMaintainer(c *core, wal *walCapture) *maintainer {
	return &maintainer{core: c, wal: wal, partitionsAhead: defaultPartitionsAhead,
		partitionMargin: min(max(c.cfg.PartitionSize, minPartitionMargin), maxPartitionMargin)}
}

func (m *maintainer) reap(ctx context.Context) {
	m.every(ctx, m.cfg.ReapInterval, "reap expired leases", func(ctx context.Context) (int64, error) {
		n, err := m.store.Reap(ctx, m.cfg.Lease)
		if err != nil {
			return 0, err
		}
		if n > 0 {
			m.obs.Reaped(int(n))
			m.logger.Warn("reaped rows whose lease expired", "rows", n, "lease", m.cfg.Lease)
			m.nudge()
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

// cleanup is the outbox's retention (see the schema, migration 00008):
// it adds ranges ahead of the ids, seals the full ones and drops whole
// ranges past retention, then deletes the few rows of outbox_default past
// theirs, in small batches.
func (m *maintainer) cleanup(ctx context.Context) {
	m.every(ctx, m.cfg.CleanupInterval, "outbox retention", func(ctx context.Context) (int64, error) {
		if err := m.keepRanges(ctx); err != nil && ctx.Err() == nil {
			// A lock not granted within the functions' lock_timeout
			// (writers, claims or a held snapshot in the way) is tried
			// again at the next pass.
			level := slog.LevelWarn
			if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
				level = slog.LevelInfo
			}
			m.logger.Log(ctx, level, "outbox ranges: will try again at the next pass", "error", err, "next_pass_in", m.cfg.CleanupInterval)
		}
		total, err := m.deleteInBatches(ctx, func(ctx context.Context) (int64, error) {
			return m.store.DeleteSent(ctx, m.cfg.SentRetention, m.cfg.CleanupBatch)
		})
		if err != nil {
			return total, err
		}
		// A wal relay leaves the rows it captured `pending`; once the
		// slot's backlog bound is known, those past retention go too.
		// Not while the slot is stuck: a row the slot has not delivered
		// is what an invalidated slot would be recovered from.
		stuck := false
		if st := m.wal.slot.Load(); st != nil && (st.Stuck > m.cfg.StallAfter || st.WALStatus == "lost") {
			stuck = true
		}
		if through := m.wal.backlogThrough.Load(); m.cfg.Capture == CaptureWAL && through >= 0 && !stuck {
			if m.wal.backlogDone.Load() {
				// A row up to the bound pending now was returned to the
				// relays since (outbox retry-failed, republish), and the
				// slot decoded that update.
				through = math.MinInt64
			}
			n, err := m.deleteInBatches(ctx, func(ctx context.Context) (int64, error) {
				return m.store.DeleteCaptured(ctx, m.cfg.SentRetention, m.cfg.CleanupBatch, through)
			})
			total += n
			if err != nil {
				return total, err
			}
		}
		if total > 0 {
			m.logger.Debug("deleted rows of outbox_default", "rows", total, "retention", m.cfg.SentRetention)
		}
		return total, nil
	})
}

// keepRanges adds the outbox's ranges ahead of the ids, seals the full
// ones, and drops the sealed ones whose rows were all published longer
// than relay.sent_retention ago. The database decides each step under its
// locks (fanout_outbox_extend, _seal, _retire); the relay only asks.
func (m *maintainer) keepRanges(ctx context.Context) error {
	added, err := m.store.ExtendPartitions(ctx, m.cfg.PartitionSize, m.partitionsAhead, m.partitionMargin)
	if err != nil {
		return fmt.Errorf("add ranges: %w", err)
	}
	if len(added) > 0 {
		m.logger.Info("added outbox ranges", "ranges", added, "ids_each", m.cfg.PartitionSize)
	}
	ranges, err := m.store.Partitions(ctx)
	if err != nil {
		return fmt.Errorf("list ranges: %w", err)
	}
	retire, canRetire, err := m.retirement(ctx)
	if err != nil {
		return err
	}
	dropped := 0
	defer func() { m.obs.OutboxRanges(len(ranges)-dropped, dropped) }()
	for _, p := range ranges {
		if p.SealedAt == nil {
			sealed, err := m.store.SealPartition(ctx, p.Name)
			if err != nil {
				return fmt.Errorf("seal range %s: %w", p.Name, err)
			}
			if !sealed {
				break // its ids are not all handed out, nor those of the ranges above it
			}
			m.logger.Debug("sealed an outbox range", "range", p.Name)
			continue // retention counts from now
		}
		if !canRetire || time.Since(*p.SealedAt) < m.cfg.SentRetention {
			continue
		}
		ok, moved, reason, err := m.store.RetirePartition(ctx, p.Name, retire)
		if err != nil {
			return fmt.Errorf("drop range %s: %w", p.Name, err)
		}
		if !ok {
			m.logger.Debug("outbox range kept", "range", p.Name, "reason", reason)
			continue
		}
		dropped++
		m.logger.Info("dropped an outbox range past retention", "range", p.Name, "failed_rows_moved_to_outbox_default", moved)
	}
	return nil
}

// retirement says what a range must meet to be dropped; ok is false when
// this relay cannot tell (a wal relay that has not yet opened its slot:
// the one that streams drops the ranges).
func (m *maintainer) retirement(ctx context.Context) (ret outboxstore.Retirement, ok bool, err error) {
	ret = outboxstore.Retirement{Retention: m.cfg.SentRetention, BacklogThrough: math.MinInt64, RequireAudit: m.cfg.Audit}
	if m.cfg.Capture != CaptureWAL {
		return ret, true, nil
	}
	ret.Captured = true
	through := m.wal.backlogThrough.Load()
	if through < 0 {
		return ret, false, nil
	}
	if !m.wal.backlogDone.Load() {
		ret.BacklogThrough = through
	}
	_, confirmed, exists, err := ReadSlot(ctx, m.pool, m.cfg.Slot)
	if err != nil || !exists {
		return ret, false, err
	}
	ret.ConfirmedLSN = confirmed
	return ret, confirmed != "", nil
}

// deleteInBatches runs del, which deletes up to relay.cleanup_batch rows,
// until it deletes fewer, and returns how many it deleted in all.
func (m *maintainer) deleteInBatches(ctx context.Context, del func(context.Context) (int64, error)) (int64, error) {
	var total int64
	for ctx.Err() == nil {
		n, err := del(ctx)
		if err != nil {
			return total, err
		}
		total += n
		m.obs.Deleted(int(n))
		if n < int64(m.cfg.CleanupBatch) {
			break
		}
	}
	return total, nil
}

// every runs job now and then every interval until ctx ends, logging errors.
func (m *maintainer) every(ctx context.Context, interval time.Duration, what string, job func(context.Context) (int64, error)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := job(ctx); err != nil && ctx.Err() == nil {
			m.logger.Error(what, "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
