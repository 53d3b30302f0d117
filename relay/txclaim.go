package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/nats-io/nats.go"
	"github.com/synadia-io/orbit.go/jetstreamext"
	"golang.org/x/sync/errgroup"
)

// A poll relay with relay.atomic transaction claims writer transactions,
// not rows (outbox.ClaimTransactions): each claimed chunk of a
// transaction (all of it, up to atomicMax events) goes as one atomic
// batch, so a subscriber sees all of it or none. Transactions claimed
// together depend on none of each other (their events' previous ones are
// published), so their batches go side by side.
//
// The claim's window starts at the lowest unpublished id: every row still
// to publish of a transaction found there below the window's end is in
// it. When nothing in a full window is ready (its transactions wait
// behind events further up), the next claim looks at the window after
// it, checking each transaction's rows below, and so on round the
// backlog: the first transaction committed among the unpublished is
// always ready (outbox/transactions.go).

// txCandidatesMax bounds the transactions one claim looks at.
const txCandidatesMax = 512

// txClaimLoop is claimLoop for relay.atomic transaction.
func (r *Relay) txClaimLoop(softCtx, hardCtx context.Context) {
	if !r.waitHandover(softCtx, hardCtx) {
		return
	}
	r.claimTransactionsIn(softCtx, hardCtx, nil, nil)
}

// claimTransactionsIn claims and publishes writer transactions until the
// relay stops: all of the outbox's (in nil), or those of a wal slot's
// backlog (drainBacklog), until finished, asked whenever a claim finds
// nothing, says they are all done.
func (r *Relay) claimTransactionsIn(softCtx, hardCtx context.Context, in *outbox.SlotBacklog, finished func() bool) {
	idle := eagerPollMin
	errWait := eagerPollMin
	batch := int64(max(r.cfg.BatchSize, atomicMax))
	after := int64(math.MinInt64)
	probed := false
	for {
		select {
		case <-r.stopping:
			return
		default:
		}
		if !r.nc.IsConnected() {
			if !r.sleep(softCtx, r.cfg.PollInterval) {
				return
			}
			continue
		}
		if err := r.slots.Acquire(softCtx, batch); err != nil {
			return
		}
		start := time.Now()
		token := newLeaseToken()
		// Going round the backlog, a wake-up (new rows, or a delivery
		// recorded: the transactions waiting behind it are ready) is
		// answered from the lowest id at once, and the walk then goes
		// on where it was: a transaction waiting for one in flight
		// does not wait for the walk's end, and wake-ups, however
		// many, never keep the walk from its end.
		from, probe := after, false
		if after != math.MinInt64 && !probed {
			select {
			case <-r.wake:
				from, probe = math.MinInt64, true
			default:
			}
		}
		probed = probe // the walk's next window comes before another probe
		// On hardCtx, as claimLoop's: cancelled after the server
		// committed, the claimed rows would wait for their lease.
		chunks, w, err := r.claimTransactions(hardCtx, from, in, token, int(batch))
		if err != nil {
			r.slots.Release(batch)
			if !r.claimFailed(softCtx, "claim outbox transactions", err, &errWait) {
				return
			}
			continue
		}
		errWait = eagerPollMin
		r.lastClaimed.Store(time.Now().UnixNano())
		n := 0
		for _, c := range chunks {
			n += len(c.Rows)
		}
		r.slots.Release(batch - int64(n))
		if w.Full || n >= int(batch) {
			// A backlog: as claimLoop's, fresh statistics of the ranges
			// holding it keep the claim on its indexes (analyzeBurst).
			r.analyzeBurst(hardCtx)
		}
		if time.Since(start) > slowTxClaim {
			r.analyzeRanges(hardCtx, analyzeSlowEvery)
		}
		switch {
		case probe && n == 0:
			continue // the walk goes on
		case probe:
		case n > 0:
			after = math.MinInt64
		case w.Full:
			after = w.Last // round the backlog: see above
			continue
		default:
			after = math.MinInt64
		}
		if n == 0 {
			if finished != nil && finished() {
				return
			}
			if !r.sleep(softCtx, idle) {
				return
			}
			idle = min(idle*2, r.cfg.PollInterval)
			continue
		}
		took := time.Since(start)
		r.obs.Claimed(n, took)
		r.logger.Debug("claimed transactions", "chunks", len(chunks), "rows", n, "took", took)
		if took > r.cfg.Lease/4 {
			// The lease runs from the claim's start: a claim this slow
			// leaves its deliveries little of it (is JIT on for the
			// relay's sessions? connect.NoJIT).
			r.logger.Warn("a claim of transactions took a quarter of the lease or more", "took", took, "lease", r.cfg.Lease, "rows", n)
		}
		idle = eagerPollMin
		// In a backlog, each delivery goes on with the transactions of the
		// next events of the aggregates it published (see
		// deliverTransactionsAsync).
		r.deliverTransactionsAsync(hardCtx, chunks, token, n, w.Full || n >= int(batch))
	}
}

// claimTransactions finds the transactions ready in the window above
// after (of the backlog in, if not nil) and claims up to n of their rows.
func (r *Relay) claimTransactions(ctx context.Context, after int64, in *outbox.SlotBacklog, token pgtype.UUID, n int) ([]outbox.TxChunk, outbox.TxWindow, error) {
	window := r.claimWindow()
	if r.testTxWindow > 0 {
		window = r.testTxWindow
	}
	w, err := r.store.TransactionCandidates(ctx, after, in, window, txCandidatesMax)
	if err != nil || len(w.Candidates) == 0 {
		return nil, w, err
	}
	// A transaction this relay is publishing chunk by chunk is its
	// stream's to claim (followTransaction): claimed here, it could only
	// wait for the chunks before it.
	cands := slices.DeleteFunc(slices.Clone(w.Candidates), func(c outbox.TxCandidate) bool { return r.txChunks.streaming(c.XID) })
	if len(cands) == 0 {
		return nil, w, nil
	}
	// Enough candidates for a batch, if each is as large as its rows in
	// the window: a transaction's first chunk is often all of it.
	for i, sum := 0, 0; i < len(cands); i++ {
		if sum += cands[i].Rows; sum >= n {
			cands = cands[:i+1]
			break
		}
	}
	chunks, err := r.store.ClaimTransactions(ctx, cands, token, atomicMax, n, after != math.MinInt64)
	return chunks, w, err
}

// deliverTransactionsAsync publishes and records claimed chunks in the
// background, holding their n slots until done. With claimNext (the claim
// loop found a backlog), it then claims, in the same slots, the ready
// transactions holding the next events of the aggregates it published,
// and delivers those the same way, until none is ready: in a backlog of
// busy aggregates most transactions wait for the one before them, and
// the claim loop, walking the backlog a window at a time, would find the
// ready ones only as its walk came round (under a snapshot held open,
// where each walk steps over every row published since, it fell behind
// 1000 writes/s for good).
func (r *Relay) deliverTransactionsAsync(hardCtx context.Context, chunks []outbox.TxChunk, token pgtype.UUID, n int, claimNext bool) {
	r.batches.Add(1)
	go func() {
		defer r.batches.Done()
		defer r.slots.Release(int64(n))
		for len(chunks) > 0 {
			small := len(chunks)*nextForSmall > n
			published := r.deliverTransactions(hardCtx, chunks, token, n)
			if !claimNext || !small || len(published) == 0 {
				return
			}
			select {
			case <-r.stopping:
				return
			default:
			}
			chunks, token = r.claimNextTransactions(hardCtx, published, n)
		}
	}()
}

// nextForSmall: a delivery goes on with the next transactions of its
// aggregates only if its transactions averaged fewer events than this.
// After large ones the next transactions are large too, most of them
// waiting for others in flight, and checking them all cost the drain of
// transactions of 1000 a fifth of its rate; the claim loop's walk is
// cheap against a batch of them. After small ones (one-event writes at a
// steady rate, a backlog building) the walk finds a few ready
// transactions per window, and without this a poll relay fell to a few
// events/s at 1000 writes/s.
const nextForSmall = 16

// claimNextTransactions claims, under a new lease, up to n rows of the
// ready transactions that hold the next events of the aggregates of
// published.
func (r *Relay) claimNextTransactions(ctx context.Context, published []row, n int) ([]outbox.TxChunk, pgtype.UUID) {
	token := newLeaseToken()
	start := time.Now()
	cands, err := r.store.NextTransactions(ctx, published)
	cands = slices.DeleteFunc(cands, func(c outbox.TxCandidate) bool { return r.txChunks.streaming(c.XID) })
	var chunks []outbox.TxChunk
	if err == nil && len(cands) > 0 {
		chunks, err = r.store.ClaimTransactions(ctx, cands, token, atomicMax, n, true)
	}
	if err != nil {
		if ctx.Err() == nil {
			r.logger.Warn("claim the transactions of the next events of the aggregates published; the claim loop will find them", "error", err)
		}
		return nil, token
	}
	claimed := 0
	for _, c := range chunks {
		claimed += len(c.Rows)
	}
	if claimed > 0 {
		r.obs.Claimed(claimed, time.Since(start))
	}
	return chunks, token
}

// deliverTransactions publishes each chunk as one atomic batch, side by
// side (at most atomicInFlight at once, as publishAtomic allows), then
// records every row's outcome in one statement. A batch the stream did
// not store leaves its rows to back off and come back together.
func (r *Relay) deliverTransactions(ctx context.Context, chunks []outbox.TxChunk, token pgtype.UUID, n int) (published []row) {
	r.unrecorded.Add(int64(n))
	defer r.unrecorded.Add(-int64(n))
	results := make([][]outcome, len(chunks))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(atomicInFlight)
	for i := range chunks {
		g.Go(func() error {
			c := &chunks[i]
			follow := r.followTransaction(ctx, c, token)
			stoppedBy := map[aggregateKey]int64{}
			res, ok := r.publishTxChunk(gctx, c, stoppedBy)
			if follow != nil {
				follow(ok && publishedWhole(res), ok, stoppedBy)
			}
			if !ok {
				return gctx.Err()
			}
			results[i] = res
			return nil
		})
	}
	if err := g.Wait(); err != nil || ctx.Err() != nil {
		return nil // a hard stop: the rows stay `sending`, the reaper returns them
	}
	rows := make([]row, 0, n)
	all := make([]outcome, 0, n)
	for i, c := range chunks {
		rows = append(rows, c.Rows...)
		all = append(all, results[i]...)
	}
	r.beforeRecord(ctx, rows)
	if _, ok := r.record(ctx, rows, token, all, nil); !ok {
		return nil
	}
	// The transactions waiting behind these are ready now: the claim
	// loop, backing off after claims that found none, claims them at once.
	r.Nudge()
	for i, res := range all {
		if res.acked {
			published = append(published, rows[i])
		}
	}
	return published
}

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

// followTransaction starts claiming the chunks of c's transaction after
// c, which was claimed under token, and returns what to call once c's
// batch is done (published: all of c that can be is in the stream; ok
// false: a hard stop), which publishes and records them in the
// background. It returns nil if c is its transaction's last chunk or the
// relay is stopping.
func (r *Relay) followTransaction(ctx context.Context, c *outbox.TxChunk, token pgtype.UUID) func(published, ok bool, stoppedBy map[aggregateKey]int64) {
	if !c.More || c.XID == "" || len(c.Rows) == 0 {
		return nil
	}
	select {
	case <-r.stopping:
		return nil
	default:
	}
	claimed := make(chan outbox.TxChunk, txClaimAhead-1)
	quit := make(chan struct{})
	lease := newLeaseToken()
	r.txChunks.stream(c.XID, true)
	r.batches.Add(1)
	go func() {
		defer r.batches.Done()
		defer close(claimed)
		r.claimChunks(ctx, c, []pgtype.UUID{token, lease}, claimed, quit)
	}()
	return func(published, ok bool, stoppedBy map[aggregateKey]int64) {
		r.batches.Add(1)
		go func() {
			defer r.batches.Done()
			r.publishChunks(ctx, claimed, quit, lease, published, ok, stoppedBy)
			r.txChunks.stream(c.XID, false)
			// Whatever is left, the claim loop takes up at once. Not
			// after each chunk: it would walk the transaction's
			// backlog in vain while the next chunk is on its way.
			r.Nudge()
		}()
	}
}

// claimChunks claims the chunks of c's transaction after c, one after the
// other, under leases[1], and hands each on, with its slots and counted
// as unrecorded; until one is not ready, the last is claimed, quit is
// closed, or the relay is stopping.
func (r *Relay) claimChunks(ctx context.Context, c *outbox.TxChunk, leases []pgtype.UUID, claimed chan<- outbox.TxChunk, quit <-chan struct{}) {
	// Slots free up as the chunks before are recorded, which waits on
	// nothing here; the wait ends with a stop or quit.
	waitCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-quit:
		case <-r.stopping:
		case <-waitCtx.Done():
		}
		cancel()
	}()
	after := c.Rows[len(c.Rows)-1].ID
	for {
		if err := r.slots.Acquire(waitCtx, atomicMax); err != nil {
			return
		}
		// On the hard context, as the claim loop's: cancelled after the
		// server committed, the claimed rows would wait for their lease.
		start := time.Now()
		next, ok, err := r.store.ClaimTransactionNext(ctx, c.XID, after, leases, leases[1], atomicMax)
		if err != nil && ctx.Err() == nil {
			r.logger.Warn("claim a transaction's next chunk: the claim loop takes it up", "transaction", c.XID, "error", err)
		}
		if err != nil || !ok {
			r.slots.Release(atomicMax)
			return
		}
		n := len(next.Rows)
		r.slots.Release(int64(atomicMax - n))
		r.unrecorded.Add(int64(n))
		r.lastClaimed.Store(time.Now().UnixNano())
		r.logger.Debug("claimed a transaction's next chunk", "transaction", c.XID, "rows", n, "took", time.Since(start))
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
func (r *Relay) publishChunks(ctx context.Context, claimed <-chan outbox.TxChunk, quit chan struct{}, lease pgtype.UUID, published, ok bool, stoppedBy map[aggregateKey]int64) {
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
			res, ok = r.publishTxChunk(ctx, &c, stoppedBy)
		}
		switch {
		case !ok: // a hard stop: the rows stay sending, for the reaper
			stop()
			r.unrecorded.Add(-int64(n))
			r.slots.Release(int64(n))
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
			defer r.slots.Release(int64(n))
			defer r.unrecorded.Add(-int64(n))
			r.beforeRecord(ctx, c.Rows)
			r.record(ctx, c.Rows, lease, res, nil)
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

// publishTxChunk publishes c's rows as one atomic batch, but for those
// that can never be published (marked failed, and under relay.on_failed
// hold the events behind them in their aggregates too) and those held
// behind an earlier failed event, of this chunk or of the chunks of its
// transaction before it (stoppedBy, which it adds to). It returns each
// row's outcome, or false if ctx ended first.
func (r *Relay) publishTxChunk(ctx context.Context, c *outbox.TxChunk, stoppedBy map[aggregateKey]int64) ([]outcome, bool) {
	results := make([]outcome, len(c.Rows))
	part, err := r.txPartOf(ctx, c)
	if err != nil {
		for i := range results {
			results[i] = outcome{err: err.Error()}
		}
		return results, ctx.Err() == nil
	}
	hold := r.store.OnFailed != outbox.SkipFailed
	maxPayload := r.nc.MaxPayload()
	var publish []int
	var msgs []*nats.Msg
	for i, rw := range c.Rows {
		numbered := hold && rw.AggregateSeq.Valid
		if numbered {
			by := c.HeldBy[i]
			if b, ok := stoppedBy[keyOf(rw)]; ok {
				by = b
			}
			if by != 0 {
				results[i] = outcome{permanent: true, err: outbox.HeldBehindReason(by)}
				stoppedBy[keyOf(rw)] = by
				continue
			}
		}
		msg, err := r.message(rw, maxPayload)
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
	if len(publish) == 0 {
		return results, true
	}
	var seqs []uint64
	if r.hooks.FailAtomic != nil && r.hooks.FailAtomic(rowIDs(c.Rows, publish)) {
		err = errors.New("nats: timeout (injected by a test hook)")
	} else if len(msgs) == 1 && !c.More && c.Prev == 0 {
		// A transaction of one event needs no atomic batch: one publish
		// is stored whole or not at all, and costs a PubAck where an
		// atomic batch of one cost the stream's batch commit (about 30
		// ms here, and at most atomicInFlight open at once: a poll relay
		// fell behind 1000 writes/s of one event each).
		i := publish[0]
		res, ok := r.publishAll(ctx, []row{c.Rows[i]}, part.setHeaders)
		if !ok {
			return nil, false
		}
		results[i] = res[0]
		if res[0].acked {
			r.txPublished(c, part)
		}
		return results, true
	} else {
		seqs, err = r.sendWhole(ctx, ctx, msgs)
	}
	switch {
	case err == nil:
		now := time.Now()
		for j, i := range publish {
			results[i] = outcome{acked: true, seq: seqs[j], ackedAt: now}
		}
		r.txPublished(c, part)
	case errors.Is(err, jetstreamext.ErrBatchPublishDuplicateMsgID):
		// Stored before (a relay stopped before it recorded the batch,
		// or a commit's answer was lost): published again one by one,
		// each is dropped as the duplicate it is and says where it
		// landed; with the batch's headers, in case the stream lost
		// them since (a store rolled back).
		r.logger.Info("a transaction's atomic batch holds events the stream already has: publishing them again one by one, as duplicates",
			"transaction", part.tx, "chunk", part.chunk, "events", len(publish))
		again := make([]row, len(publish))
		for j, i := range publish {
			again[j] = c.Rows[i]
		}
		res, ok := r.publishAll(ctx, again, part.setHeaders)
		if !ok {
			return nil, false
		}
		for j, i := range publish {
			results[i] = res[j]
		}
		r.txPublished(c, part)
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

// txChunks remembers, for the transactions of more than atomicMax events
// whose chunks this relay is publishing, the last chunk published, so
// that the next is numbered without counting the rows before it, and
// which of them a stream of chunks is publishing (followTransaction).
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

// txPartOf says what c's batch carries: its transaction and the chunk
// number. A chunk after the first is the one after the chunk this relay
// last published of the transaction if that one ends just below it, and
// otherwise is counted from the rows below it.
func (r *Relay) txPartOf(ctx context.Context, c *outbox.TxChunk) (txPart, error) {
	p := txPart{tx: c.XID, chunk: 1, last: !c.More}
	if c.XID == "" {
		// Written before the outbox kept transactions: one of its own.
		p.tx = "row:" + strconv.FormatInt(c.Rows[0].ID, 10)
		return p, nil
	}
	if c.Prev == 0 {
		return p, nil
	}
	r.txChunks.mu.Lock()
	seen, ok := r.txChunks.last[c.XID]
	r.txChunks.mu.Unlock()
	if ok && seen.lastID == c.Prev {
		p.chunk = seen.chunk + 1
		return p, nil
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	below, err := r.store.TransactionRowsBelow(ctx, c.XID, c.Rows[0].ID)
	if err != nil {
		return p, err
	}
	p.chunk = int((below+atomicMax-1)/atomicMax) + 1
	return p, nil
}

// txPublished remembers a chunk published (txPartOf).
func (r *Relay) txPublished(c *outbox.TxChunk, p txPart) {
	if c.XID == "" {
		return
	}
	r.txChunks.mu.Lock()
	defer r.txChunks.mu.Unlock()
	if !c.More {
		delete(r.txChunks.last, c.XID)
		return
	}
	if r.txChunks.last == nil || len(r.txChunks.last) >= txChunksMax {
		r.txChunks.last = map[string]txChunkSeen{}
	}
	r.txChunks.last[c.XID] = txChunkSeen{chunk: p.chunk, lastID: c.Rows[len(c.Rows)-1].ID}
}

// rowIDs returns the ids of rows[i] for each i of which.
func rowIDs(rows []outbox.Claimed, which []int) []int64 {
	ids := make([]int64, len(which))
	for j, i := range which {
		ids[j] = rows[i].ID
	}
	return ids
}
