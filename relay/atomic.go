package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// Atomic batches (NATS 2.12, ADR-50) carry an aggregate's events in
// order at the pace of the stream, not of a round trip per event.
//
// Per-aggregate order lets an event go only once the one before it is in
// the stream: publishing the next before the previous is acknowledged
// would let a failed and retried publish land behind it. So a batch
// holding a chain of one aggregate's events went a wave at a time, a
// round trip per event: one transaction of 300,000 events of one
// aggregate drained at about 2,500 rows/s. An atomic batch is stored
// whole, in the order sent, or not at all, so a chain in one batch is in
// order whatever fails. The stream must allow it (allow_atomic, set by
// `fanout provision`); where it does not, the relay publishes a wave at a
// time as before.
//
// The server keeps each batch's messages together and numbers them in
// order: the batch's acknowledgement gives the last one's sequence, and
// the others are the ones before it, which is where the audit looks for
// them. A batch holding an event the stream already has (a duplicate, by
// Nats-Msg-Id) is refused whole; the relay then publishes those rows a
// wave at a time, and JetStream drops the duplicates as it always does.

// atomicMax is the most messages one atomic batch holds: nats-server's
// default limit (jetstream.limits.max_batch_size).
const atomicMax = 1000

// atomicInFlight bounds the atomic batches one relay has open at once:
// the server allows 50 per stream, shared by every relay of every
// database that publishes into it.
const atomicInFlight = 8

// errNotAtomic says a set of rows cannot go as atomic batches (the
// stream does not allow them, a row can never be published, a test hook
// steers single publishes): the caller publishes them one by one.
var errNotAtomic = errors.New("not publishable as an atomic batch")

// publishChain publishes rows, in their order, as atomic batches of at
// most atomicMax, each once the one before is stored. It returns the
// outcomes of the rows stored (every one acknowledged), how many they
// are (a prefix of rows), and the error that stopped it before the end.
// rows must be in an order that keeps each aggregate's events in theirs.
func (r *Relay) publishChain(ctx context.Context, rows []row) ([]outcome, int, error) {
	if !r.atomicOK.Load() || r.hooks.FailPublish != nil || r.hooks.SkipPublish != nil || r.hooks.Anonymous {
		return nil, 0, errNotAtomic
	}
	if err := r.guardOrigin(ctx); err != nil {
		return nil, 0, err
	}
	maxPayload := r.nc.MaxPayload()
	msgs := make([]*nats.Msg, len(rows))
	for i, rw := range rows {
		msg, err := r.message(rw, maxPayload)
		if err != nil {
			return nil, 0, fmt.Errorf("%w: %s", errNotAtomic, rowReason(rw.ID, err))
		}
		msgs[i] = msg
	}
	results := make([]outcome, len(rows))
	done := 0
	for done < len(rows) {
		end := min(done+atomicMax, len(rows))
		if r.hooks.FailAtomic != nil {
			ids := make([]int64, end-done)
			for i := range ids {
				ids[i] = rows[done+i].ID
			}
			if r.hooks.FailAtomic(ids) {
				return results[:done], done, errors.New("atomic batch: nats: timeout (injected by a test hook)")
			}
		}
		if r.hooks.AtomicReversed {
			slices.Reverse(msgs[done:end])
		}
		last, err := r.publishAtomic(ctx, msgs[done:end])
		if err != nil {
			return results[:done], done, err
		}
		now := time.Now()
		for i := done; i < end; i++ {
			results[i] = outcome{acked: true, seq: last - uint64(end-1-i), ackedAt: now}
		}
		done = end
	}
	return results, done, nil
}

// publishAtomic publishes msgs as one atomic batch and returns the stream
// sequence of the last.
func (r *Relay) publishAtomic(ctx context.Context, msgs []*nats.Msg) (uint64, error) {
	if err := r.atomicSlots.Acquire(ctx, 1); err != nil {
		return 0, err
	}
	defer r.atomicSlots.Release(1)
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	// No acknowledgement of the first message: one round trip a batch. A
	// stream that refuses the batch says so in the commit's answer.
	var ack *jetstreamext.BatchAck
	var err error
	if r.hooks.MidBatch != nil {
		ack, err = r.publishAtomicHalting(ctx, msgs)
	} else {
		ack, err = jetstreamext.PublishMsgBatch(ctx, r.js, msgs, jetstreamext.BatchFlowControl{AckFirst: false})
	}
	r.obs.AtomicBatch(len(msgs), err)
	r.logger.Debug("atomic batch", "events", len(msgs), "refused", err != nil)
	if err != nil {
		return 0, fmt.Errorf("atomic batch of %d events: %w", len(msgs), err)
	}
	if ack.Stream != r.stream.Name {
		return 0, fmt.Errorf("atomic batch of %d events stored in stream %s, not %s", len(msgs), ack.Stream, r.stream.Name)
	}
	return ack.Sequence, nil
}

// publishAtomicHalting is publishAtomic's batch sent a message at a time,
// with the test hook MidBatch run halfway.
func (r *Relay) publishAtomicHalting(ctx context.Context, msgs []*nats.Msg) (*jetstreamext.BatchAck, error) {
	b, err := jetstreamext.NewBatchPublisher(r.js)
	if err != nil {
		return nil, err
	}
	for i, msg := range msgs[:len(msgs)-1] {
		if i == len(msgs)/2 {
			r.hooks.MidBatch()
		}
		if err := b.AddMsg(msg); err != nil {
			return nil, err
		}
	}
	return b.CommitMsg(ctx, msgs[len(msgs)-1])
}

// txPart names what one atomic batch of relay.atomic transaction carries:
// a writer transaction (its commit's position in the write-ahead log), or
// the chunk-th of its chunks of atomicMax events, last or not.
type txPart struct {
	tx    string
	chunk int
	last  bool
}

// setHeaders marks msg as an event of p.
func (p txPart) setHeaders(msg *nats.Msg) {
	msg.Header[outbox.TxHeader] = []string{p.tx}
	msg.Header[outbox.TxChunkHeader] = []string{strconv.Itoa(p.chunk)}
	if p.last {
		msg.Header[outbox.TxLastHeader] = []string{"true"}
	}
}

// publishTransaction publishes a wal chunk of relay.atomic transaction:
// every row of it in one atomic batch, once the events before them in
// their aggregates are done, or none. A row that can never be published
// is marked failed (with those behind it in its aggregate, and rows held
// behind an earlier failed event: relay.on_failed hold), and the others
// go without it. A batch the stream does not store is tried again, with
// backoff, for as long as it takes: going without the batch would let a
// subscriber see part of the transaction. It returns false if the relay
// stopped first, or a row before one of these was abandoned.
func (r *Relay) publishTransaction(softCtx, hardCtx context.Context, c *ordered, p txPart) bool {
	defer r.order.abandon(c) // a no-op for the rows done
	own := make(map[*turn]bool, len(c.rows))
	inChunk := make(map[int64]bool, len(c.rows))
	for i, rw := range c.rows {
		own[c.own[i]] = true
		inChunk[rw.ID] = true
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

	hold := r.store.OnFailed != outbox.SkipFailed
	maxPayload := r.nc.MaxPayload()
	var (
		publish           []row
		msgs              []*nats.Msg
		failedIDs         []int64
		failedReasons     []string
		poisons           []row
		stoppedBy         = map[aggregateKey]int64{} // a row of this chunk that failed
		heldN, poisonRows int
	)
	for _, rw := range c.rows {
		if hold && rw.AggregateSeq.Valid {
			by, held := stoppedBy[keyOf(rw)]
			if !held {
				// Held behind an earlier failed event, unless that one is
				// in this chunk (an operator's retry returns it with them).
				if b, ok := r.order.heldBehind(rw); ok && !inChunk[b] {
					by, held = b, true
				}
			}
			if held {
				failedIDs, failedReasons = append(failedIDs, rw.ID), append(failedReasons, outbox.HeldBehindReason(by))
				heldN++
				continue
			}
		}
		msg, err := r.message(rw, maxPayload)
		if err != nil {
			failedIDs, failedReasons = append(failedIDs, rw.ID), append(failedReasons, rowReason(rw.ID, err))
			poisons = append(poisons, rw)
			poisonRows++
			if hold && rw.AggregateSeq.Valid {
				stoppedBy[keyOf(rw)] = rw.ID
			}
			continue
		}
		p.setHeaders(msg)
		publish, msgs = append(publish, rw), append(msgs, msg)
	}
	if len(publish) > 0 && !r.publishTransactionBatch(softCtx, hardCtx, p, publish, msgs) {
		return false
	}
	if len(failedIDs) > 0 {
		if !r.failCaptured(softCtx, failedIDs, failedReasons) {
			return false
		}
		for _, rw := range poisons {
			if hold && rw.AggregateSeq.Valid {
				r.order.hold(rw)
			}
		}
		if len(publish) > 0 {
			r.logger.Warn("a transaction's events went without those that can never be published, and those held behind them",
				"transaction", p.tx, "published", len(publish), "failed", poisonRows, "held", heldN)
		}
	}
	for _, rw := range publish {
		r.order.release(rw)
	}
	for i := range c.rows {
		r.order.leave(c, i, false)
	}
	return true
}

// publishTransactionBatch publishes msgs, the events of rows, as one
// atomic batch, trying again until the stream stores it, records where
// they landed and reports them. A batch holding an event the stream
// already has was stored before (by a relay that stopped before the slot
// moved past it, or a commit whose answer was lost): its events are
// published again one by one, each dropped as the duplicate it is, which
// says where it landed.
func (r *Relay) publishTransactionBatch(softCtx, hardCtx context.Context, p txPart, rows []row, msgs []*nats.Msg) bool {
	if r.stillInStream(hardCtx, rows) {
		now := time.Now()
		published := make([]Published, len(rows))
		for i, rw := range rows {
			published[i] = Published{ID: rw.ID, CreatedAt: rw.CreatedAt.Time, AckedAt: now, Duplicate: true}
		}
		r.logger.Debug("a transaction decoded again is in the stream where it landed: not published again",
			"transaction", p.tx, "chunk", p.chunk, "events", len(rows))
		r.reportPublished(published, 0, 0)
		return true
	}
	if len(msgs) == 1 {
		// One event needs no atomic batch (see publishTxChunk): one
		// publish, tried again until stored, its landing recorded.
		failed, ok := r.publishCaptured(softCtx, hardCtx, rows, p.setHeaders)
		if rw := rows[0]; ok && failed[rw.ID] && r.store.OnFailed != outbox.SkipFailed && rw.AggregateSeq.Valid {
			r.order.hold(rw) // marked failed: its aggregate's next events wait behind it
		}
		return ok
	}
	wait := min(r.cfg.RetryMin, r.outageRetryMax())
	for {
		seqs, err := r.sendWhole(softCtx, hardCtx, msgs)
		if err == nil {
			now := time.Now()
			published := make([]Published, len(rows))
			landed := make([]outbox.Landed, len(rows))
			for i, rw := range rows {
				published[i] = Published{ID: rw.ID, CreatedAt: rw.CreatedAt.Time, AckedAt: now}
				landed[i] = outbox.Landed{ID: rw.ID, Seq: seqs[i]}
			}
			if !r.recordCaptured(hardCtx, landed) {
				return false
			}
			r.reportPublished(published, 0, 0)
			return true
		}
		if errors.Is(err, jetstreamext.ErrBatchPublishDuplicateMsgID) {
			r.logger.Info("a transaction's atomic batch holds events the stream already has: publishing them again one by one, as duplicates",
				"transaction", p.tx, "chunk", p.chunk, "events", len(rows))
			// With the batch's headers: if the stream lost them since it
			// said so (a store rolled back), they are stored again one by
			// one, still marked as the transaction's.
			failed, ok := r.publishCaptured(softCtx, hardCtx, rows, p.setHeaders)
			if ok && len(failed) > 0 {
				r.logger.Error("events of a transaction published one by one failed", "transaction", p.tx, "failed", len(failed))
			}
			return ok
		}
		if hardCtx.Err() != nil {
			return false
		}
		r.obs.Retried(len(rows))
		r.logger.Warn("a transaction's atomic batch was not stored; retrying, the slot waits for it",
			"transaction", p.tx, "chunk", p.chunk, "events", len(rows), "error", err, "retry_in", wait)
		if !r.sleep(softCtx, wait) {
			return false
		}
		wait = min(wait*2, r.outageRetryMax())
	}
}

// stillInStream says whether every row of a chunk decoded again is still
// in the stream where it landed before (replayed: each row's LandedSeq):
// a relay that stopped before its slot moved past a transaction, or a
// reconnect, leaves its batches to be decoded again, and sent again each
// would be refused whole as holding duplicates, then go one by one. One
// batch direct get says so at the cost of one round trip. Anything else (a
// row without a landing, landings spread out, a message missing or
// another one there, an error) says no: the chunk goes as usual, and
// JetStream's duplicate detection stays the judge.
func (r *Relay) stillInStream(ctx context.Context, rows []row) bool {
	ident := r.identity.Load()
	if ident == nil || len(rows) == 0 {
		return false
	}
	want := make(map[uint64]string, len(rows))
	lo, hi := uint64(math.MaxUint64), uint64(0)
	for _, rw := range rows {
		if rw.LandedSeq == 0 {
			return false
		}
		want[rw.LandedSeq] = outbox.MsgID(ident.OriginOf(rw.ID), rw.ID)
		lo, hi = min(lo, rw.LandedSeq), max(hi, rw.LandedSeq)
	}
	if len(want) != len(rows) || hi-lo >= uint64(2*len(rows)) {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	msgs, err := jetstreamext.GetBatch(ctx, r.js, r.stream.Name, int(hi-lo+1), jetstreamext.GetBatchSeq(lo))
	if err != nil {
		return false
	}
	found := 0
	for m, err := range msgs {
		if err != nil || m.Sequence > hi {
			break
		}
		if id, ok := want[m.Sequence]; ok && m.Header.Get(jetstream.MsgIDHeader) == id {
			found++
		}
	}
	return found == len(rows)
}

// sendWhole is sendTransaction once the relay may publish (guardOrigin)
// into a stream that allows atomic batches: relay.atomic transaction has
// no other way to publish a transaction.
func (r *Relay) sendWhole(softCtx, hardCtx context.Context, msgs []*nats.Msg) ([]uint64, error) {
	if err := r.guardOrigin(hardCtx); err != nil {
		return nil, err
	}
	if !r.atomicOK.Load() {
		return nil, fmt.Errorf("the stream %s does not allow atomic batches: set allow_atomic (`fanout provision --update-stream %s`)", r.stream.Name, r.stream.Name)
	}
	return r.sendTransaction(softCtx, hardCtx, msgs)
}

// sendTransaction publishes msgs as one atomic batch and returns each
// one's stream sequence. With the sabotage hook SplitTransactions it
// sends them as two batches, 200 ms apart: others may land between.
func (r *Relay) sendTransaction(softCtx, hardCtx context.Context, msgs []*nats.Msg) ([]uint64, error) {
	parts := [][]*nats.Msg{msgs}
	if half := len(msgs) / 2; r.hooks.SplitTransactions && half > 0 {
		parts = [][]*nats.Msg{msgs[:half], msgs[half:]}
	}
	seqs := make([]uint64, 0, len(msgs))
	for i, part := range parts {
		if i > 0 && !r.sleep(softCtx, 200*time.Millisecond) {
			return nil, softCtx.Err()
		}
		last, err := r.publishAtomic(hardCtx, part)
		if err != nil {
			return nil, err
		}
		for j := range part {
			seqs = append(seqs, last-uint64(len(part)-1-j))
		}
	}
	return seqs, nil
}
