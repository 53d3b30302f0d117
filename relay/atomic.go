package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/fanout/fanout/wire"
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
func (p *publisher) publishChain(ctx context.Context, rows []row) ([]outcome, int, error) {
	if !p.atomicOK.Load() || p.hooks.FailPublish != nil || p.hooks.SkipPublish != nil || p.hooks.Anonymous {
		return nil, 0, errNotAtomic
	}
	if err := p.origin.guard(ctx); err != nil {
		return nil, 0, err
	}
	maxPayload := p.nc.MaxPayload()
	msgs := make([]*nats.Msg, len(rows))
	for i, rw := range rows {
		msg, err := p.message(rw, maxPayload)
		if err != nil {
			return nil, 0, fmt.Errorf("%w: %s", errNotAtomic, rowReason(rw.ID, err))
		}
		msgs[i] = msg
	}
	results := make([]outcome, len(rows))
	done := 0
	for done < len(rows) {
		end := min(done+atomicMax, len(rows))
		if p.hooks.FailAtomic != nil {
			ids := make([]int64, end-done)
			for i := range ids {
				ids[i] = rows[done+i].ID
			}
			if p.hooks.FailAtomic(ids) {
				return results[:done], done, errors.New("atomic batch: nats: timeout (injected by a test hook)")
			}
		}
		if p.hooks.AtomicReversed {
			slices.Reverse(msgs[done:end])
		}
		last, err := p.publishAtomic(ctx, msgs[done:end])
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
func (p *publisher) publishAtomic(ctx context.Context, msgs []*nats.Msg) (uint64, error) {
	if err := p.atomicSlots.Acquire(ctx, 1); err != nil {
		return 0, err
	}
	defer p.atomicSlots.Release(1)
	ctx, cancel := context.WithTimeout(ctx, p.cfg.PublishTimeout)
	defer cancel()
	// No acknowledgement of the first message: one round trip a batch. A
	// stream that refuses the batch says so in the commit's answer.
	var ack *jetstreamext.BatchAck
	var err error
	if p.hooks.MidBatch != nil {
		ack, err = p.publishAtomicHalting(ctx, msgs)
	} else {
		ack, err = jetstreamext.PublishMsgBatch(ctx, p.js, msgs, jetstreamext.BatchFlowControl{AckFirst: false})
	}
	p.obs.AtomicBatch(len(msgs), err)
	p.logger.Debug("atomic batch", "events", len(msgs), "refused", err != nil)
	if err != nil {
		return 0, fmt.Errorf("atomic batch of %d events: %w", len(msgs), err)
	}
	if ack.Stream != p.stream.Name {
		return 0, fmt.Errorf("atomic batch of %d events stored in stream %s, not %s", len(msgs), ack.Stream, p.stream.Name)
	}
	return ack.Sequence, nil
}

// publishAtomicHalting is publishAtomic's batch sent a message at a time,
// with the test hook MidBatch run halfway.
func (p *publisher) publishAtomicHalting(ctx context.Context, msgs []*nats.Msg) (*jetstreamext.BatchAck, error) {
	b, err := jetstreamext.NewBatchPublisher(p.js)
	if err != nil {
		return nil, err
	}
	for i, msg := range msgs[:len(msgs)-1] {
		if i == len(msgs)/2 {
			p.hooks.MidBatch()
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
	msg.Header[wire.TxHeader] = []string{p.tx}
	msg.Header[wire.TxChunkHeader] = []string{strconv.Itoa(p.chunk)}
	if p.last {
		msg.Header[wire.TxLastHeader] = []string{"true"}
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
func (p *publisher) stillInStream(ctx context.Context, rows []row) bool {
	ident := p.origin.identity.Load()
	if ident == nil || len(rows) == 0 {
		return false
	}
	want := make(map[uint64]string, len(rows))
	lo, hi := uint64(math.MaxUint64), uint64(0)
	for _, rw := range rows {
		if rw.LandedSeq == 0 {
			return false
		}
		want[rw.LandedSeq] = wire.MsgID(ident.OriginOf(rw.ID), rw.ID)
		lo, hi = min(lo, rw.LandedSeq), max(hi, rw.LandedSeq)
	}
	if len(want) != len(rows) || hi-lo >= uint64(2*len(rows)) {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.PublishTimeout)
	defer cancel()
	msgs, err := jetstreamext.GetBatch(ctx, p.js, p.stream.Name, int(hi-lo+1), jetstreamext.GetBatchSeq(lo))
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

// sendWhole is sendTransaction once the relay may publish (origin guard)
// into a stream that allows atomic batches: relay.atomic transaction has
// no other way to publish a transaction.
func (p *publisher) sendWhole(softCtx, hardCtx context.Context, msgs []*nats.Msg) ([]uint64, error) {
	if err := p.origin.guard(hardCtx); err != nil {
		return nil, err
	}
	if !p.atomicOK.Load() {
		return nil, fmt.Errorf("the stream %s does not allow atomic batches: set allow_atomic (`fanout provision --update-stream %s`)", p.stream.Name, p.stream.Name)
	}
	return p.sendTransaction(softCtx, hardCtx, msgs)
}

// errRelayStopping ends a wait that a stop cut short.
var errRelayStopping = errors.New("relay stopping")

// sendTransaction publishes msgs as one atomic batch and returns each
// one's stream sequence. With the sabotage hook SplitTransactions it
// sends them as two batches, 200 ms apart: others may land between.
func (p *publisher) sendTransaction(softCtx, hardCtx context.Context, msgs []*nats.Msg) ([]uint64, error) {
	parts := [][]*nats.Msg{msgs}
	if half := len(msgs) / 2; p.hooks.SplitTransactions && half > 0 {
		parts = [][]*nats.Msg{msgs[:half], msgs[half:]}
	}
	seqs := make([]uint64, 0, len(msgs))
	for i, part := range parts {
		if i > 0 && !p.sleep(softCtx, 200*time.Millisecond) {
			// A stop ends the wait with softCtx still live: its nil
			// error with no sequences read as stored (a panic, seen
			// under load).
			return nil, fmt.Errorf("split transaction's second half not sent: %w", cmp.Or(softCtx.Err(), errRelayStopping))
		}
		last, err := p.publishAtomic(hardCtx, part)
		if err != nil {
			return nil, err
		}
		for j := range part {
			seqs = append(seqs, last-uint64(len(part)-1-j))
		}
	}
	return seqs, nil
}
