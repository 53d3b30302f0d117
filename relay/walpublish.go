package relay

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outboxstore"
	"github.com/nats-io/nats.go"
)

// errNotVisibleYet: a decoded row is not visible to other sessions yet.
var errNotVisibleYet = errors.New("decoded row not visible yet")

// visibleWithin bounds the wait for a decoded row to become visible.
const visibleWithin = 5 * time.Second

// dispatch publishes the current transaction's rows collected so far as
// one chunk (last: the transaction's), waiting for room in flight
// (relay.max_in_flight) first.
func (s *walStream) dispatch(softCtx, hardCtx context.Context, last bool) error {
	if len(s.rows) == 0 {
		return nil
	}
	rows, refetch := s.rows, s.refetch
	s.rows, s.refetch = nil, nil
	clear(s.rowAt)
	n := int64(len(rows))
	for {
		ctx, cancel := context.WithTimeout(softCtx, walStatusInterval)
		err := s.w.slots.Acquire(ctx, n)
		cancel()
		if err == nil {
			break
		}
		if softCtx.Err() != nil {
			return softCtx.Err()
		}
		// Stay in touch with the server while the publishes catch up.
		if err := s.sendStatus(softCtx); err != nil {
			return err
		}
	}
	txn := s.cur
	txn.parts++
	part := txPart{tx: txn.final.String(), chunk: txn.parts, last: last}
	// A transaction's chunks enter the stream in their order.
	before, partDone := txn.lastPart, make(chan struct{})
	txn.lastPart = partDone
	txn.chunks.Add(1)
	s.w.batches.Add(1)
	// Each row takes its place in its aggregate's order here, in the
	// order decoded, and is published once the one before it is done.
	c := s.w.order.enter(rows)
	go func() {
		defer s.w.batches.Done()
		defer s.w.slots.Release(n)
		defer txn.chunks.Done()
		defer s.w.order.abandon(c) // a no-op for the rows done
		defer close(partDone)
		// On the stream's flight context: a graceful stop lets the chunk
		// finish (streamSlot).
		flight := s.flight
		if h := s.w.testHookChunk; h != nil {
			h(c.rows)
		}
		// Every row of a transaction is dispatched at its commit or after
		// it (a chunk that filled up earlier waits here the same way).
		if err := s.w.visibility.wait(flight, txn.xid); err != nil {
			txn.abandoned.Store(true)
			return
		}
		if len(refetch) > 0 {
			kept, ok := s.w.refetchCaptured(flight, rows, refetch)
			if !ok {
				txn.abandoned.Store(true)
				return
			}
			c = s.w.order.keep(c, kept)
		}
		if slices.ContainsFunc(c.rows, func(rw row) bool { return rw.ID <= s.landedThrough }) {
			if !s.w.replayed(flight, c.rows, s.landedThrough) {
				txn.abandoned.Store(true)
				return
			}
		}
		published := false
		if s.w.cfg.Atomic == AtomicTransaction {
			if before != nil {
				select {
				case <-before:
				case <-flight.Done():
					txn.abandoned.Store(true)
					return
				}
			}
			published = !txn.abandoned.Load() && s.w.publishTransaction(flight, hardCtx, c, part)
		} else {
			published = s.w.publishOrdered(flight, hardCtx, c)
		}
		if !published {
			txn.abandoned.Store(true)
		}
	}()
	return nil
}

// publishCaptured publishes rows decoded from the slot until every one has
// a PubAck or is marked failed: the slot is not confirmed past them before,
// so a publish that fails for a reason outside the row (NATS down, the
// stream unavailable) is retried with backoff, for as long as it takes. It
// returns the ids it marked failed, and false if the relay stopped first.
func (w *walCapture) publishCaptured(softCtx, hardCtx context.Context, rows []row, decorate ...func(*nats.Msg)) (failed map[int64]bool, ok bool) {
	wait := min(w.cfg.RetryMin, w.outageRetryMax())
	for {
		if len(rows) == 0 {
			return failed, true
		}
		results, ok := w.pub.publishAll(hardCtx, rows, decorate...)
		if !ok {
			return nil, false
		}
		var (
			retry            []row
			failedIDs        []int64
			failedReasons    []string
			published        []Published
			landed           []outboxstore.Landed
			firstRetryReason string
			repaired         int
		)
		for i, res := range results {
			switch {
			case res.acked:
				published = append(published, Published{ID: rows[i].ID, CreatedAt: rows[i].CreatedAt.Time, AckedAt: res.ackedAt, Duplicate: res.duplicate})
				if rows[i].LandedSeq > 0 && !res.duplicate {
					repaired++
					w.logger.Warn("decoded again, an event was missing from the stream: published again",
						"event_id", rows[i].ID, "stream_seq", rows[i].LandedSeq, "new_stream_seq", res.seq)
				}
				if res.seq > 0 {
					landed = append(landed, outboxstore.Landed{ID: rows[i].ID, Seq: res.seq})
				}
			case res.permanent:
				failedIDs = append(failedIDs, rows[i].ID)
				failedReasons = append(failedReasons, res.err)
			default:
				if retry == nil {
					firstRetryReason = res.err
				}
				retry = append(retry, rows[i])
			}
		}
		// Recorded before the slot may move past them: a relay killed after
		// the confirm leaves no published event without its landing. On
		// hardCtx: a relay stopping records what it published, and so
		// may confirm it (the next relay would publish it again).
		if !w.recordCaptured(hardCtx, landed) {
			return nil, false
		}
		w.delivery.reportPublished(published, len(retry), len(failedIDs))
		if repaired > 0 {
			w.obs.Audited(AuditReplay, 0, repaired, repaired)
		}
		if len(failedIDs) > 0 {
			if !w.failCaptured(softCtx, failedIDs, failedReasons) {
				return nil, false
			}
			if failed == nil {
				failed = map[int64]bool{}
			}
			for _, id := range failedIDs {
				failed[id] = true
			}
		}
		if len(retry) == 0 {
			return failed, true
		}
		w.obs.Retried(len(retry))
		w.logger.Warn("publish failed; retrying, the slot waits for these rows", "rows", len(retry), "first_id", retry[0].ID, "error", firstRetryReason, "retry_in", wait)
		if !w.sleep(softCtx, wait) {
			return nil, false
		}
		wait = min(wait*2, w.outageRetryMax())
		rows = retry
	}
}

// recordCaptured records where a wal relay's published rows landed,
// retrying while Postgres is unreachable.
func (w *walCapture) recordCaptured(ctx context.Context, landed []outboxstore.Landed) bool {
	if len(landed) == 0 {
		return true
	}
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		return struct{}{}, w.store.RecordLandings(ctx, w.stream.Name, landed)
	}, backoff.WithBackOff(postgresRetry()), backoff.WithMaxElapsedTime(0), backoff.WithNotify(func(err error, next time.Duration) {
		w.logger.Warn("record where published rows landed, will retry", "error", err, "retry_in", next, "rows", len(landed))
	}))
	return err == nil
}

// failCaptured marks rows failed, retrying while Postgres is unreachable.
//
// The walsender may decode a commit a moment before the transaction is
// visible to other sessions, so a row the update did not find is looked
// for again, for a while, before it is taken as deleted since.
func (w *walCapture) failCaptured(ctx context.Context, ids []int64, reasons []string) bool {
	missing := map[int64]string{}
	for i, id := range ids {
		missing[id] = reasons[i]
	}
	invisibleSince := time.Now()
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		var ids []int64
		var reasons []string
		for id, reason := range missing {
			ids, reasons = append(ids, id), append(reasons, reason)
		}
		marked, err := w.store.FailUnclaimed(ctx, ids, reasons)
		if err != nil {
			return struct{}{}, err
		}
		for _, id := range marked {
			delete(missing, id)
		}
		if len(missing) > 0 && time.Since(invisibleSince) < visibleWithin {
			return struct{}{}, errNotVisibleYet
		}
		return struct{}{}, nil
	}, backoff.WithBackOff(postgresRetry()), backoff.WithMaxElapsedTime(0), backoff.WithNotify(func(err error, next time.Duration) {
		if !errors.Is(err, errNotVisibleYet) {
			w.logger.Warn("mark unpublishable rows failed, will retry", "error", err, "retry_in", next, "rows", len(ids))
		}
	}))
	if err != nil {
		return false
	}
	for id := range missing {
		w.logger.Warn("an unpublishable row decoded from the slot is no longer in the outbox (deleted since?): not marked failed", "event_id", id, "reason", missing[id])
	}
	w.obs.Failed(len(ids) - len(missing))
	for i, id := range ids {
		if _, gone := missing[id]; !gone {
			w.logger.Error("outbox row can never be published: marked failed", "event_id", id, "reason", reasons[i])
		}
	}
	return true
}

// replayed looks up where the rows up to landedThrough (ids) landed when
// published before: a stream starts from the slot's confirmed position,
// so it decodes again what was published and not yet confirmed (by this
// relay before a reconnect, or by the one before it). Each such row's
// message carries its landing (wire.RepairedHeader): JetStream drops it
// as a duplicate, unless the stream lost the earlier copy (a store that
// lost its last writes), and then the copy stored again is a repair, as
// the auditor's are, and says where it was lost from. False: the relay
// stopped first.
//
// A row published by a relay still finishing its work after the bound was
// read goes without its landing: it is a duplicate as well, unless lost,
// and then only its header is missing.
func (w *walCapture) replayed(ctx context.Context, rows []row, landedThrough int64) bool {
	ids := make([]int64, 0, len(rows))
	for _, rw := range rows {
		if rw.ID <= landedThrough {
			ids = append(ids, rw.ID)
		}
	}
	landed, err := backoff.Retry(ctx, func() (map[int64]uint64, error) {
		return w.store.NewestLandings(ctx, w.stream.Name, ids)
	}, backoff.WithBackOff(postgresRetry()), backoff.WithMaxElapsedTime(0), backoff.WithNotify(func(err error, next time.Duration) {
		w.logger.Warn("read where decoded-again rows landed, will retry", "error", err, "retry_in", next, "rows", len(ids))
	}))
	if err != nil {
		return false
	}
	for i := range rows {
		rows[i].LandedSeq = landed[rows[i].ID]
	}
	return true
}

// refetchCaptured reads again, from the table, the rows at indexes refetch:
// an update that did not touch a value stored out of line (TOAST) decodes
// without it. A row no longer pending and unpublished (claimed by a poll
// relay, marked, deleted since) is left out: whoever changed it owns it.
func (w *walCapture) refetchCaptured(ctx context.Context, rows []row, refetch []int) ([]row, bool) {
	ids := make([]int64, len(refetch))
	for i, at := range refetch {
		ids[i] = rows[at].ID
	}
	fresh, err := backoff.Retry(ctx, func() ([]row, error) {
		return w.store.Unpublished(ctx, ids)
	}, backoff.WithBackOff(postgresRetry()), backoff.WithMaxElapsedTime(0), backoff.WithNotify(func(err error, next time.Duration) {
		w.logger.Warn("read updated outbox rows again, will retry", "error", err, "retry_in", next, "rows", len(ids))
	}))
	if err != nil {
		return nil, false
	}
	byID := make(map[int64]row, len(fresh))
	for _, f := range fresh {
		byID[f.ID] = f
	}
	kept := make([]row, 0, len(rows))
	next := 0
	for i, rw := range rows {
		if next < len(refetch) && refetch[next] == i {
			next++
			f, ok := byID[rw.ID]
			if !ok {
				w.logger.Warn("an updated outbox row decoded without its payload is no longer pending when read again (claimed, marked or deleted since): not published by the slot", "event_id", rw.ID)
				continue
			}
			rw = f
		}
		kept = append(kept, rw)
	}
	return kept, true
}

// outageWaitMax bounds the wait between two tries of a wal relay's
// publish that failed for a reason outside its rows (NATS unreachable,
// the stream without a leader, a batch unanswered). The slot waits for
// those rows, and every event behind them waits too: a wait that doubled
// up to relay.retry_max (5 minutes by default) through an outage of a
// minute would hold them for a minute more once it ended. (A poll
// relay's rows back off each on its own: the others go.)
const outageWaitMax = 5 * time.Second

// outageRetryMax is the longest wait between two tries of a wal relay's
// publish: outageWaitMax, or relay.retry_max if shorter.
func (w *walCapture) outageRetryMax() time.Duration { return min(w.cfg.RetryMax, outageWaitMax) }

// postgresRetry is the backoff of a wal relay's calls to Postgres that
// must succeed before the slot moves on.
func postgresRetry() *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{
		InitialInterval: 10 * time.Millisecond, RandomizationFactor: 0.3, Multiplier: 2, MaxInterval: 2 * time.Second,
	}
}
