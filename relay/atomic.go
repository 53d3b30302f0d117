package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
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
	ack, err := jetstreamext.PublishMsgBatch(ctx, r.js, msgs, jetstreamext.BatchFlowControl{AckFirst: false})
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
