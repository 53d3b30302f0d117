package relay

import (
	"context"
	"errors"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/nats-io/nats.go"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// relay.atomic transaction in wal capture: the decoder cuts each writer
// transaction into chunks of atomicMax rows (waldecode.go), and each
// chunk goes as one atomic batch once the events before its rows in their
// aggregates are done.

// publishTransaction publishes a wal chunk of relay.atomic transaction:
// every row of it in one atomic batch, once the events before them in
// their aggregates are done, or none. A row that can never be published
// is marked failed (with those behind it in its aggregate, and rows held
// behind an earlier failed event: relay.on_failed hold), and the others
// go without it. A batch the stream does not store is tried again, with
// backoff, for as long as it takes: going without the batch would let a
// subscriber see part of the transaction. It returns false if the relay
// stopped first, or a row before one of these was abandoned.
func (w *walCapture) publishTransaction(softCtx, hardCtx context.Context, c *ordered, p txPart) bool {
	defer w.order.abandon(c) // a no-op for the rows done
	if !w.afterEarlierEvents(softCtx, c) {
		return false
	}
	hold := w.store.OnFailed != outboxstore.SkipFailed
	m := w.transactionMessages(c, p, hold)
	if len(m.publish) > 0 && !w.publishTransactionBatch(softCtx, hardCtx, p, m.publish, m.msgs) {
		return false
	}
	if len(m.failedIDs) > 0 {
		if !w.failCaptured(softCtx, m.failedIDs, m.failedReasons) {
			return false
		}
		for _, rw := range m.poisons {
			if hold && rw.AggregateSeq.Valid {
				w.order.hold(rw)
			}
		}
		if len(m.publish) > 0 {
			w.logger.Warn("a transaction's events went without those that can never be published, and those held behind them",
				"transaction", p.tx, "published", len(m.publish), "failed", len(m.poisons), "held", m.held)
		}
	}
	for _, rw := range m.publish {
		w.order.release(rw)
	}
	for i := range c.rows {
		w.order.leave(c, i, false)
	}
	return true
}

// afterEarlierEvents waits until the events before c's rows in their
// aggregates, outside c, are done; false if one was abandoned or the
// relay stopped.
func (w *walCapture) afterEarlierEvents(softCtx context.Context, c *ordered) bool {
	own := make(map[*turn]bool, len(c.rows))
	for i := range c.rows {
		own[c.own[i]] = true
	}
	for i := range c.rows {
		if prev := c.prev[i]; prev != nil && !own[prev] {
			select {
			case <-prev.done:
				if prev.abandoned {
					return false
				}
			case <-softCtx.Done():
				return false
			}
		}
	}
	return true
}

// txMessages is what a wal chunk of relay.atomic transaction publishes
// (publish, as msgs) and what it marks failed: rows that can never be
// published (poisons) and, under relay.on_failed hold, rows held behind a
// failed event (held of them).
type txMessages struct {
	publish       []row
	msgs          []*nats.Msg
	failedIDs     []int64
	failedReasons []string
	poisons       []row
	held          int
}

func (w *walCapture) transactionMessages(c *ordered, p txPart, hold bool) txMessages {
	inChunk := make(map[int64]bool, len(c.rows))
	for _, rw := range c.rows {
		inChunk[rw.ID] = true
	}
	maxPayload := w.nc.MaxPayload()
	stoppedBy := map[aggregateKey]int64{} // a row of this chunk that failed
	var m txMessages
	for _, rw := range c.rows {
		if hold && rw.AggregateSeq.Valid {
			by, held := stoppedBy[keyOf(rw)]
			if !held {
				// Held behind an earlier failed event, unless that one is
				// in this chunk (an operator's retry returns it with them).
				if b, ok := w.order.heldBehind(rw); ok && !inChunk[b] {
					by, held = b, true
				}
			}
			if held {
				m.failedIDs, m.failedReasons = append(m.failedIDs, rw.ID), append(m.failedReasons, outboxstore.HeldBehindReason(by))
				m.held++
				continue
			}
		}
		msg, err := w.pub.message(rw, maxPayload)
		if err != nil {
			m.failedIDs, m.failedReasons = append(m.failedIDs, rw.ID), append(m.failedReasons, rowReason(rw.ID, err))
			m.poisons = append(m.poisons, rw)
			if hold && rw.AggregateSeq.Valid {
				stoppedBy[keyOf(rw)] = rw.ID
			}
			continue
		}
		p.setHeaders(msg)
		m.publish, m.msgs = append(m.publish, rw), append(m.msgs, msg)
	}
	return m
}

// publishTransactionBatch publishes msgs, the events of rows, as one
// atomic batch, trying again until the stream stores it, records where
// they landed and reports them. A batch holding an event the stream
// already has was stored before (by a relay that stopped before the slot
// moved past it, or a commit whose answer was lost): its events are
// published again one by one, each dropped as the duplicate it is, which
// says where it landed.
func (w *walCapture) publishTransactionBatch(softCtx, hardCtx context.Context, p txPart, rows []row, msgs []*nats.Msg) bool {
	if w.pub.stillInStream(hardCtx, rows) {
		now := time.Now()
		published := make([]Published, len(rows))
		for i, rw := range rows {
			published[i] = Published{ID: rw.ID, CreatedAt: rw.CreatedAt.Time, AckedAt: now, Duplicate: true}
		}
		w.logger.Debug("a transaction decoded again is in the stream where it landed: not published again",
			"transaction", p.tx, "chunk", p.chunk, "events", len(rows))
		w.delivery.reportPublished(published, 0, 0)
		return true
	}
	if len(msgs) == 1 {
		// One event needs no atomic batch (see txDelivery.publishChunk): one
		// publish, tried again until stored, its landing recorded.
		failed, ok := w.publishCaptured(softCtx, hardCtx, rows, p.setHeaders)
		if rw := rows[0]; ok && failed[rw.ID] && w.store.OnFailed != outboxstore.SkipFailed && rw.AggregateSeq.Valid {
			w.order.hold(rw) // marked failed: its aggregate's next events wait behind it
		}
		return ok
	}
	wait := min(w.cfg.RetryMin, w.outageRetryMax())
	for {
		seqs, err := w.pub.sendWhole(softCtx, hardCtx, msgs)
		if err == nil {
			now := time.Now()
			published := make([]Published, len(rows))
			landed := make([]outboxstore.Landed, len(rows))
			for i, rw := range rows {
				published[i] = Published{ID: rw.ID, CreatedAt: rw.CreatedAt.Time, AckedAt: now}
				landed[i] = outboxstore.Landed{ID: rw.ID, Seq: seqs[i]}
			}
			if !w.recordCaptured(hardCtx, landed) {
				return false
			}
			w.delivery.reportPublished(published, 0, 0)
			return true
		}
		if errors.Is(err, jetstreamext.ErrBatchPublishDuplicateMsgID) {
			w.logger.Info("a transaction's atomic batch holds events the stream already has: publishing them again one by one, as duplicates",
				"transaction", p.tx, "chunk", p.chunk, "events", len(rows))
			// With the batch's headers: if the stream lost them since it
			// said so (a store rolled back), they are stored again one by
			// one, still marked as the transaction's.
			failed, ok := w.publishCaptured(softCtx, hardCtx, rows, p.setHeaders)
			if ok && len(failed) > 0 {
				w.logger.Error("events of a transaction published one by one failed", "transaction", p.tx, "failed", len(failed))
			}
			return ok
		}
		if hardCtx.Err() != nil {
			return false
		}
		w.obs.Retried(len(rows))
		w.logger.Warn("a transaction's atomic batch was not stored; retrying, the slot waits for it",
			"transaction", p.tx, "chunk", p.chunk, "events", len(rows), "error", err, "retry_in", wait)
		if !w.sleep(softCtx, wait) {
			return false
		}
		wait = min(wait*2, w.outageRetryMax())
	}
}
