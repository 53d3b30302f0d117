package relay

import (
	"context"
	"math"
	"slices"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pgx/v5/pgtype"
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
// always ready (outboxstore/transactions.go).

// txCandidatesMax bounds the transactions one claim looks at.
const txCandidatesMax = 512

// txDelivery is the poll relay's delivery with relay.atomic transaction
// (and a wal relay's, of its slot's backlog): it claims writer
// transactions, not rows, and publishes each claimed chunk as one atomic
// batch.
type txDelivery struct {
	*core
	pub      *publisher
	delivery *delivery // records the outcomes
	stats    *rangeStats
	wal      *walCapture // finishes a switch from wal capture first
	chunks   txChunks    // the big transactions' chunks published
	// testWindow, when set, is the claim's window (Config.claimWindow).
	testWindow int
}

// run is the claim loop for relay.atomic transaction.
func (t *txDelivery) run(softCtx, hardCtx context.Context) {
	if !t.wal.waitHandover(softCtx, hardCtx) {
		return
	}
	t.claimIn(softCtx, hardCtx, nil, nil)
}

// claimIn claims and publishes writer transactions until the relay
// stops: all of the outbox's (in nil), or those of a wal slot's backlog
// (drainBacklog), until finished, asked whenever a claim finds nothing,
// says they are all done.
func (t *txDelivery) claimIn(softCtx, hardCtx context.Context, in *outboxstore.SlotBacklog, finished func() bool) {
	batch := int64(max(t.cfg.BatchSize, atomicMax))
	after := int64(math.MinInt64)
	probed := false
	t.runClaims(softCtx, "claim outbox transactions", batch, func(token pgtype.UUID) (claimRound, error) {
		start := time.Now()
		// Going round the backlog, a wake-up (new rows, or a delivery
		// recorded: the transactions waiting behind it are ready) is
		// answered from the lowest id at once, and the walk then goes
		// on where it was: a transaction waiting for one in flight
		// does not wait for the walk's end, and wake-ups, however
		// many, never keep the walk from its end.
		from, probe := after, false
		if after != math.MinInt64 && !probed {
			select {
			case <-t.wake:
				from, probe = math.MinInt64, true
			default:
			}
		}
		probed = probe // the walk's next window comes before another probe
		// On hardCtx, as the event claim's: cancelled after the server
		// committed, the claimed rows would wait for their lease.
		chunks, w, err := t.claim(hardCtx, from, in, token, int(batch))
		if err != nil {
			return claimRound{}, err
		}
		n := 0
		for _, c := range chunks {
			n += len(c.Rows)
		}
		if w.Full || n >= int(batch) {
			// A backlog: as the event claim's, fresh statistics of the
			// ranges holding it keep the claim on its indexes.
			t.stats.burst(hardCtx)
		}
		if time.Since(start) > slowTxClaim {
			t.stats.refresh(hardCtx, analyzeSlowEvery)
		}
		switch {
		case probe && n == 0:
			return claimRound{walkOn: true}, nil // the walk goes on
		case probe:
		case n > 0:
			after = math.MinInt64
		case w.Full:
			after = w.Last // round the backlog: see above
			return claimRound{walkOn: true}, nil
		default:
			after = math.MinInt64
		}
		if n == 0 {
			return claimRound{}, nil
		}
		took := time.Since(start)
		t.logger.Debug("claimed transactions", "chunks", len(chunks), "rows", n, "took", took)
		if took > t.cfg.Lease/4 {
			// The lease runs from the claim's start: a claim this slow
			// leaves its deliveries little of it (is JIT on for the
			// relay's sessions? connect.NoJIT).
			t.logger.Warn("a claim of transactions took a quarter of the lease or more", "took", took, "lease", t.cfg.Lease, "rows", n)
		}
		// In a backlog, each delivery goes on with the transactions of the
		// next events of the aggregates it published (see deliverAsync).
		backlog := w.Full || n >= int(batch)
		return claimRound{n: n, deliver: func() { t.deliverAsync(hardCtx, chunks, token, n, backlog) }}, nil
	}, finished)
}

// claim finds the transactions ready in the window above
// after (of the backlog in, if not nil) and claims up to n of their rows.
func (t *txDelivery) claim(ctx context.Context, after int64, in *outboxstore.SlotBacklog, token pgtype.UUID, n int) ([]outboxstore.TxChunk, outboxstore.TxWindow, error) {
	window := t.cfg.claimWindow()
	if t.testWindow > 0 {
		window = t.testWindow
	}
	w, err := t.store.TransactionCandidates(ctx, after, in, window, txCandidatesMax)
	if err != nil || len(w.Candidates) == 0 {
		return nil, w, err
	}
	// A transaction this relay is publishing chunk by chunk is its
	// stream's to claim (follow): claimed here, it could only
	// wait for the chunks before it.
	cands := slices.DeleteFunc(slices.Clone(w.Candidates), func(c outboxstore.TxCandidate) bool { return t.chunks.streaming(c.XID) })
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
	chunks, err := t.store.ClaimTransactions(ctx, cands, token, atomicMax, n, after != math.MinInt64)
	return chunks, w, err
}

// deliverAsync publishes and records claimed chunks in the
// background, holding their n slots until done. With claimNext (the claim
// loop found a backlog), it then claims, in the same slots, the ready
// transactions holding the next events of the aggregates it published,
// and delivers those the same way, until none is ready: in a backlog of
// busy aggregates most transactions wait for the one before them, and
// the claim loop, walking the backlog a window at a time, would find the
// ready ones only as its walk came round (under a snapshot held open,
// where each walk steps over every row published since, it fell behind
// 1000 writes/s for good).
func (t *txDelivery) deliverAsync(hardCtx context.Context, chunks []outboxstore.TxChunk, token pgtype.UUID, n int, claimNext bool) {
	t.batches.Add(1)
	go func() {
		defer t.batches.Done()
		defer t.slots.Release(int64(n))
		for len(chunks) > 0 {
			small := len(chunks)*nextForSmall > n
			published := t.deliver(hardCtx, chunks, token, n)
			if !claimNext || !small || len(published) == 0 {
				return
			}
			select {
			case <-t.stopping:
				return
			default:
			}
			chunks, token = t.claimNext(hardCtx, published, n)
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

// claimNext claims, under a new lease, up to n rows of the
// ready transactions that hold the next events of the aggregates of
// published.
func (t *txDelivery) claimNext(ctx context.Context, published []row, n int) ([]outboxstore.TxChunk, pgtype.UUID) {
	token := newLeaseToken()
	start := time.Now()
	cands, err := t.store.NextTransactions(ctx, published)
	cands = slices.DeleteFunc(cands, func(c outboxstore.TxCandidate) bool { return t.chunks.streaming(c.XID) })
	var chunks []outboxstore.TxChunk
	if err == nil && len(cands) > 0 {
		chunks, err = t.store.ClaimTransactions(ctx, cands, token, atomicMax, n, true)
	}
	if err != nil {
		if ctx.Err() == nil {
			t.logger.Warn("claim the transactions of the next events of the aggregates published; the claim loop will find them", "error", err)
		}
		return nil, token
	}
	claimed := 0
	for _, c := range chunks {
		claimed += len(c.Rows)
	}
	if claimed > 0 {
		t.obs.Claimed(claimed, time.Since(start))
	}
	return chunks, token
}

// deliver publishes each chunk as one atomic batch, side by
// side (at most atomicInFlight at once, as publishAtomic allows), then
// records every row's outcome in one statement. A batch the stream did
// not store leaves its rows to back off and come back together.
func (t *txDelivery) deliver(ctx context.Context, chunks []outboxstore.TxChunk, token pgtype.UUID, n int) (published []row) {
	t.unrecorded.Add(int64(n))
	defer t.unrecorded.Add(-int64(n))
	results := make([][]outcome, len(chunks))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(atomicInFlight)
	for i := range chunks {
		g.Go(func() error {
			c := &chunks[i]
			follow := t.follow(ctx, c, token)
			stoppedBy := map[aggregateKey]int64{}
			res, ok := t.publishChunk(gctx, c, stoppedBy)
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
	t.delivery.beforeRecord(ctx, rows)
	if _, ok := t.delivery.record(ctx, rows, token, all, nil); !ok {
		return nil
	}
	// The transactions waiting behind these are ready now: the claim
	// loop, backing off after claims that found none, claims them at once.
	t.nudge()
	for i, res := range all {
		if res.acked {
			published = append(published, rows[i])
		}
	}
	return published
}
