package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/nats-io/nats.go"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// A big transaction's chunks go one after the other, each once the ones
// before are in the stream (a chunk's events may follow events of their
// aggregates in the chunks before). While a chunk publishes, the relay
// claims the next ones (outbox.ClaimTransactionNext: the rows below them
// may be sending under this relay's leases), up to txClaimAhead, and
// records each chunk while the next publishes: a chunk costs its claim or
// its batch, whichever is longer, rather than a claim, a batch and a
// record. Wherever this stops (a chunk not ready, a batch the stream did
// not store, a stop), the claim loop takes the transaction up again.

// txClaimAhead bounds the chunks of a transaction claimed and not yet
// published.
const txClaimAhead = 2

// follow starts claiming the chunks of c's transaction after
// c, which was claimed under token, and returns what to call once c's
// batch is done (published: all of c that can be is in the stream; ok
// false: a hard stop), which publishes and records them in the
// background. It returns nil if c is its transaction's last chunk or the
// relay is stopping.
func (t *txDelivery) follow(ctx context.Context, c *outboxstore.TxChunk, token pgtype.UUID) func(published, ok bool, stoppedBy map[aggregateKey]int64) {
	if !c.More || c.XID == "" || len(c.Rows) == 0 {
		return nil
	}
	select {
	case <-t.stopping:
		return nil
	default:
	}
	claimed := make(chan outboxstore.TxChunk, txClaimAhead-1)
	quit := make(chan struct{})
	lease := newLeaseToken()
	t.chunks.stream(c.XID, true)
	t.batches.Add(1)
	go func() {
		defer t.batches.Done()
		defer close(claimed)
		t.claimChunks(ctx, c, []pgtype.UUID{token, lease}, claimed, quit)
	}()
	return func(published, ok bool, stoppedBy map[aggregateKey]int64) {
		t.batches.Add(1)
		go func() {
			defer t.batches.Done()
			t.publishChunks(ctx, claimed, quit, lease, published, ok, stoppedBy)
			t.chunks.stream(c.XID, false)
			// Whatever is left, the claim loop takes up at once. Not
			// after each chunk: it would walk the transaction's
			// backlog in vain while the next chunk is on its way.
			t.nudge()
		}()
	}
}

// claimChunks claims the chunks of c's transaction after c, one after the
// other, under leases[1], and hands each on, with its slots and counted
// as unrecorded; until one is not ready, the last is claimed, quit is
// closed, or the relay is stopping.
func (t *txDelivery) claimChunks(ctx context.Context, c *outboxstore.TxChunk, leases []pgtype.UUID, claimed chan<- outboxstore.TxChunk, quit <-chan struct{}) {
	// Slots free up as the chunks before are recorded, which waits on
	// nothing here; the wait ends with a stop or quit.
	waitCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-quit:
		case <-t.stopping:
		case <-waitCtx.Done():
		}
		cancel()
	}()
	after := c.Rows[len(c.Rows)-1].ID
	for {
		if err := t.slots.Acquire(waitCtx, atomicMax); err != nil {
			return
		}
		// On the hard context, as the claim loop's: cancelled after the
		// server committed, the claimed rows would wait for their lease.
		start := time.Now()
		next, ok, err := t.store.ClaimTransactionNext(ctx, c.XID, after, leases, leases[1], atomicMax)
		if err != nil && ctx.Err() == nil {
			t.logger.Warn("claim a transaction's next chunk: the claim loop takes it up", "transaction", c.XID, "error", err)
		}
		if err != nil || !ok {
			t.slots.Release(atomicMax)
			return
		}
		n := len(next.Rows)
		t.slots.Release(int64(atomicMax - n))
		t.unrecorded.Add(int64(n))
		t.touch()
		t.logger.Debug("claimed a transaction's next chunk", "transaction", c.XID, "rows", n, "took", time.Since(start))
		claimed <- next // publishChunks takes every chunk until claimed closes
		if !next.More {
			return
		}
		after = next.Rows[n-1].ID
	}
}

// publishChunks publishes the chunks claimChunks hands on, each once the
// one before it went whole into the stream (published), and records each
// while the next publishes. After one that did not, the rest go back to
// wait with it, to follow it again (no attempt counted); after a hard
// stop (ok false), they stay sending for the reaper. stoppedBy holds the
// aggregates stopped by a failed event in the chunks before.
func (t *txDelivery) publishChunks(ctx context.Context, claimed <-chan outboxstore.TxChunk, quit chan struct{}, lease pgtype.UUID, published, ok bool, stoppedBy map[aggregateKey]int64) {
	var records sync.WaitGroup
	var quitOnce sync.Once
	stop := func() { quitOnce.Do(func() { close(quit) }) }
	defer func() {
		stop()
		records.Wait()
	}()
	for c := range claimed {
		n := len(c.Rows)
		var res []outcome
		if ok && published {
			res, ok = t.publishChunk(ctx, &c, stoppedBy)
		}
		switch {
		case !ok: // a hard stop: the rows stay sending, for the reaper
			stop()
			t.unrecorded.Add(-int64(n))
			t.slots.Release(int64(n))
			continue
		case published:
			published = publishedWhole(res)
		default:
			stop()
			res = make([]outcome, n)
			for i := range res {
				res[i] = outcome{returned: true}
			}
		}
		records.Add(1)
		go func() {
			defer records.Done()
			defer t.slots.Release(int64(n))
			defer t.unrecorded.Add(-int64(n))
			t.delivery.beforeRecord(ctx, c.Rows)
			t.delivery.record(ctx, c.Rows, lease, res, nil)
		}()
	}
}

// publishedWhole says whether a chunk's events are all in the stream but
// those that never will be (failed, or held behind a failed event): the
// chunk after it may go.
func publishedWhole(res []outcome) bool {
	for _, o := range res {
		if !o.acked && !o.permanent {
			return false
		}
	}
	return true
}

// publishChunk publishes c's rows as one atomic batch, but for those
// that can never be published (marked failed, and under relay.on_failed
// hold the events behind them in their aggregates too) and those held
// behind an earlier failed event, of this chunk or of the chunks of its
// transaction before it (stoppedBy, which it adds to). It returns each
// row's outcome, or false if ctx ended first.
func (t *txDelivery) publishChunk(ctx context.Context, c *outboxstore.TxChunk, stoppedBy map[aggregateKey]int64) ([]outcome, bool) {
	results := make([]outcome, len(c.Rows))
	part, err := t.partOf(ctx, c)
	if err != nil {
		for i := range results {
			results[i] = outcome{err: err.Error()}
		}
		return results, ctx.Err() == nil
	}
	publish, msgs := t.chunkMessages(c, part, stoppedBy, results)
	if len(publish) == 0 {
		return results, true
	}
	failed := t.hooks.FailAtomic != nil && t.hooks.FailAtomic(rowIDs(c.Rows, publish))
	if !failed && len(msgs) == 1 && !c.More && c.Prev == 0 {
		// A transaction of one event needs no atomic batch: one publish
		// is stored whole or not at all, and costs a PubAck where an
		// atomic batch of one cost the stream's batch commit (about 30
		// ms here, and at most atomicInFlight open at once: a poll relay
		// fell behind 1000 writes/s of one event each).
		i := publish[0]
		res, ok := t.pub.publishAll(ctx, []row{c.Rows[i]}, part.setHeaders)
		if !ok {
			return nil, false
		}
		results[i] = res[0]
		if res[0].acked {
			t.published(c, part)
		}
		return results, true
	}
	var seqs []uint64
	if failed {
		err = errors.New("nats: timeout (injected by a test hook)")
	} else {
		seqs, err = t.pub.sendWhole(ctx, ctx, msgs)
	}
	switch {
	case err == nil:
		now := time.Now()
		for j, i := range publish {
			results[i] = outcome{acked: true, seq: seqs[j], ackedAt: now}
		}
		t.published(c, part)
	case errors.Is(err, jetstreamext.ErrBatchPublishDuplicateMsgID):
		// Stored before (a relay stopped before it recorded the batch,
		// or a commit's answer was lost): published again one by one,
		// each is dropped as the duplicate it is and says where it
		// landed; with the batch's headers, in case the stream lost
		// them since (a store rolled back).
		t.logger.Info("a transaction's atomic batch holds events the stream already has: publishing them again one by one, as duplicates",
			"transaction", part.tx, "chunk", part.chunk, "events", len(publish))
		again := make([]row, len(publish))
		for j, i := range publish {
			again[j] = c.Rows[i]
		}
		res, ok := t.pub.publishAll(ctx, again, part.setHeaders)
		if !ok {
			return nil, false
		}
		for j, i := range publish {
			results[i] = res[j]
		}
		t.published(c, part)
	default:
		if ctx.Err() != nil {
			return nil, false
		}
		for _, i := range publish {
			results[i] = outcome{err: fmt.Sprintf("atomic batch of transaction %s: %v", part.tx, err)}
		}
	}
	return results, true
}

// chunkMessages builds the messages of c's rows that go in its batch, and
// says which rows those are: the others can never be published (results
// says why), or are held behind a failed event (stoppedBy, which it adds
// to).
func (t *txDelivery) chunkMessages(c *outboxstore.TxChunk, part txPart, stoppedBy map[aggregateKey]int64, results []outcome) (publish []int, msgs []*nats.Msg) {
	hold := t.store.OnFailed != outboxstore.SkipFailed
	maxPayload := t.nc.MaxPayload()
	for i, rw := range c.Rows {
		numbered := hold && rw.AggregateSeq.Valid
		if numbered {
			by := c.HeldBy[i]
			if b, ok := stoppedBy[keyOf(rw)]; ok {
				by = b
			}
			if by != 0 {
				results[i] = outcome{permanent: true, err: outboxstore.HeldBehindReason(by)}
				stoppedBy[keyOf(rw)] = by
				continue
			}
		}
		msg, err := t.pub.message(rw, maxPayload)
		if err != nil {
			results[i] = outcome{permanent: true, err: rowReason(rw.ID, err)}
			if numbered {
				stoppedBy[keyOf(rw)] = rw.ID
			}
			continue
		}
		part.setHeaders(msg)
		publish, msgs = append(publish, i), append(msgs, msg)
	}
	return publish, msgs
}

// txChunks remembers, for the transactions of more than atomicMax events
// whose chunks this relay is publishing, the last chunk published, so
// that the next is numbered without counting the rows before it, and
// which of them a stream of chunks is publishing (follow).
type txChunks struct {
	mu      sync.Mutex
	last    map[string]txChunkSeen
	streams map[string]int
}

// stream notes a stream of xid's chunks starting (on) or ending.
func (t *txChunks) stream(xid string, on bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.streams == nil {
		t.streams = map[string]int{}
	}
	if on {
		t.streams[xid]++
	} else if t.streams[xid]--; t.streams[xid] <= 0 {
		delete(t.streams, xid)
	}
}

// streaming says whether a stream of xid's chunks is publishing.
func (t *txChunks) streaming(xid string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.streams[xid] > 0
}

type txChunkSeen struct {
	chunk  int
	lastID int64
}

// txChunksMax bounds the transactions remembered: a relay that stops
// seeing one (another relay took its chunks) forgets it, eventually.
const txChunksMax = 1024

// partOf says what c's batch carries: its transaction and the chunk
// number. A chunk after the first is the one after the chunk this relay
// last published of the transaction if that one ends just below it, and
// otherwise is counted from the rows below it.
func (t *txDelivery) partOf(ctx context.Context, c *outboxstore.TxChunk) (txPart, error) {
	p := txPart{tx: c.XID, chunk: 1, last: !c.More}
	if c.XID == "" {
		// Written before the outbox kept transactions: one of its own.
		p.tx = "row:" + strconv.FormatInt(c.Rows[0].ID, 10)
		return p, nil
	}
	if c.Prev == 0 {
		return p, nil
	}
	t.chunks.mu.Lock()
	seen, ok := t.chunks.last[c.XID]
	t.chunks.mu.Unlock()
	if ok && seen.lastID == c.Prev {
		p.chunk = seen.chunk + 1
		return p, nil
	}
	ctx, cancel := context.WithTimeout(ctx, t.cfg.PublishTimeout)
	defer cancel()
	below, err := t.store.TransactionRowsBelow(ctx, c.XID, c.Rows[0].ID)
	if err != nil {
		return p, err
	}
	p.chunk = int((below+atomicMax-1)/atomicMax) + 1
	return p, nil
}

// published remembers a chunk published (partOf).
func (t *txDelivery) published(c *outboxstore.TxChunk, p txPart) {
	if c.XID == "" {
		return
	}
	t.chunks.mu.Lock()
	defer t.chunks.mu.Unlock()
	if !c.More {
		delete(t.chunks.last, c.XID)
		return
	}
	if t.chunks.last == nil || len(t.chunks.last) >= txChunksMax {
		t.chunks.last = map[string]txChunkSeen{}
	}
	t.chunks.last[c.XID] = txChunkSeen{chunk: p.chunk, lastID: c.Rows[len(c.Rows)-1].ID}
}

// rowIDs returns the ids of rows[i] for each i of which.
func rowIDs(rows []outboxstore.Claimed, which []int) []int64 {
	ids := make([]int64, len(which))
	for j, i := range which {
		ids[j] = rows[i].ID
	}
	return ids
}
