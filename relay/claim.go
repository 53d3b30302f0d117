package relay

import (
	"cmp"
	"context"
	"crypto/rand"
	"math"
	"slices"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5/pgtype"
)

// fullClaimEvery is how often the sweeper claims the rows below the
// floor, walking from the lowest id; the claim loop starts from the floor
// (see claimSQL for why). A row below it (a lease reaped, a backoff over,
// an operator's retry, a writer whose transaction committed long after it
// took its id) waits for the next sweep, at most this long.
const fullClaimEvery = time.Second

// eagerPollMin is the first wait after a claim that found nothing; it
// doubles up to the poll interval.
const eagerPollMin = time.Millisecond

// claimLoop is the poll relay's: it claims a batch (claim) as soon as
// one fits in flight (relay.max_in_flight) and hands it to a delivery of
// its own (deliverAsync), backing off while claims find nothing or fail.
func (r *Relay) claimLoop(softCtx, hardCtx context.Context) {
	// After wal capture, rows its relays published are still pending:
	// they must be told apart before the first claim (handover.go).
	if !r.waitHandover(softCtx, hardCtx) {
		return
	}
	r.loops.Add(1)
	go func() {
		defer r.loops.Done()
		r.sweepLoop(softCtx, hardCtx)
	}()
	idle := eagerPollMin
	errWait := eagerPollMin
	batch := int64(r.cfg.BatchSize)
	for {
		select {
		case <-r.stopping:
			return
		default:
		}
		if !r.nc.IsConnected() {
			// Claiming now would only burn attempts; rows wait as pending.
			if !r.sleep(softCtx, r.cfg.PollInterval) {
				return
			}
			continue
		}
		if err := r.slots.Acquire(softCtx, batch); err != nil {
			return
		}
		// The claim runs on hardCtx: cancelling it after the server committed
		// would strand the claimed rows until their lease expires.
		start := time.Now()
		rows, token, backlog, err := r.claim(hardCtx)
		if err != nil {
			r.slots.Release(batch)
			if !r.claimFailed(softCtx, "claim outbox batch", err, &errWait) {
				return
			}
			continue
		}
		errWait = eagerPollMin
		r.lastClaimed.Store(time.Now().UnixNano())
		r.slots.Release(batch - int64(len(rows)))
		if len(rows) == 0 {
			if !r.sleep(softCtx, idle) {
				return
			}
			idle = min(idle*2, r.cfg.PollInterval)
			continue
		}
		r.obs.Claimed(len(rows), time.Since(start))
		idle = eagerPollMin
		r.deliverAsync(hardCtx, rows, token, backlog)
	}
}

// claimFailed records and logs a claim's error and waits errWait before
// the next claim, doubling it for the time after; it returns false if
// the relay stopped meanwhile.
func (r *Relay) claimFailed(softCtx context.Context, what string, err error, errWait *time.Duration) bool {
	msg := err.Error()
	r.lastClaimErr.Store(&msg)
	r.markOriginStale() // Postgres may be back from a restore
	r.logger.Error(what, "error", err, "retry_in", *errWait)
	if !r.sleep(softCtx, *errWait) {
		return false
	}
	*errWait = min(*errWait*2, max(r.cfg.PollInterval, time.Second))
	return true
}

// row is one claimed outbox row.
type row = outbox.Claimed

// newLeaseToken returns the random token that fences a claim's writes.
func newLeaseToken() pgtype.UUID {
	var u pgtype.UUID
	_, _ = rand.Read(u.Bytes[:]) // crypto/rand.Read never fails
	u.Valid = true
	return u
}

// claimFloor splits the claims: the claim loop takes rows above the floor,
// the sweeper those at or below it.
type claimFloor struct {
	after atomic.Int64 // the floor: the claim loop starts above this id
	// newest is the highest id the claim loop has looked at: the last row
	// it claimed, or the newest row in the outbox when a claim came back
	// short (it walked to the end). With per-aggregate order most of a
	// backlog is rows waiting for the event before them, which only the
	// deliveries that published that event claim (ClaimNext): counting
	// them as looked at keeps the claim loop from walking the whole
	// backlog at every claim.
	newest atomic.Int64
	next   int64 // the floor after the next sweep (the sweeper's)
}

// swept moves the floor after a sweep to the newest id looked at when the
// previous sweep began. Ids are taken in order, so a row below it that
// was not claimed yet belongs to a transaction open since before then, at
// least fullClaimEvery ago: the floor lags a sweep behind the newest rows
// so that only such rows (and the ones a sweep is there for) fall below it.
func (f *claimFloor) swept(newestAtStart int64) {
	f.raise(f.next)
	f.next = newestAtStart
}

// raise moves the floor up to id, never down.
func (f *claimFloor) raise(id int64) { atLeast(&f.after, id) }

// saw records that the claim loop has looked at every row up to id.
func (f *claimFloor) saw(id int64) { atLeast(&f.newest, id) }

// atLeast raises v to id if it is lower.
func atLeast(v *atomic.Int64, id int64) {
	for {
		cur := v.Load()
		if id <= cur || v.CompareAndSwap(cur, id) {
			return
		}
	}
}

// heads is the claim loop's walk round the aggregates (claim): where it
// goes on, and the newest id when its round began.
type heads struct {
	after        outbox.AggregateKey
	newestAtTurn int64
}

// claimWindow is how many unpublished rows above the floor a claim walks
// by id: the rows in flight (up to max_in_flight), and as many again.
func (r *Relay) claimWindow() int { return 2 * r.cfg.MaxInFlight }

// claim claims the claim loop's next batch. backlog says whether rows
// wait beyond it (a full batch, or a full window): only then do its
// deliveries go on with the next events of the aggregates they publish
// (ClaimNext). Otherwise the next events are new rows, which the next
// claims find; claiming after every small batch, mostly in vain, cost more
// than the claims themselves at a steady 1000 writes/s (bench:relay's held
// horizon: 35,671 such claims in three minutes took 11,533 rows).
func (r *Relay) claim(ctx context.Context) (_ []row, _ pgtype.UUID, backlog bool, _ error) {
	token := newLeaseToken()
	// Nothing is decoded in the claim: message() judges each row on its
	// own, and a bad row becomes `failed`.
	w, err := r.store.ClaimWindow(ctx, r.cfg.BatchSize, token, r.floor.after.Load(), math.MaxInt64, r.claimWindow())
	if err != nil {
		return nil, token, false, err
	}
	backlog = w.Full || len(w.Claimed) == r.cfg.BatchSize
	// Or a small backlog of events waiting behind the ones claimed (a
	// transaction of one order's thousand lines): without ClaimNext they
	// would go one per aggregate per claim. Rows in flight are among the
	// unpublished, and a few held behind a failed event or backing off
	// are not worth the next claims.
	if waiting := w.Unsent - len(w.Claimed) - int(r.unrecorded.Load()); waiting >= max(len(w.Claimed), minWaitingForNext) {
		backlog = true
	}
	if backlog {
		r.analyzeBurst(ctx)
	}
	claimed := w.Claimed
	switch {
	case len(claimed) == r.cfg.BatchSize:
		r.floor.saw(claimed[len(claimed)-1].ID)
	case !w.Full:
		r.floor.saw(w.Newest)
	case r.hooks.Unordered:
		r.floor.saw(w.End)
	default:
		// More rows wait above the window than a claim walks, most of
		// them, as a rule, events waiting for the one before them (a
		// backlog of busy aggregates, drained a few events of each at a
		// time by ClaimNext). A walk by id would probe each of them; a
		// walk round the aggregates probes each aggregate once, and
		// finds the heads anywhere in the backlog, the newest rows' too.
		if r.heads.after == (outbox.AggregateKey{}) {
			r.heads.newestAtTurn = w.Newest
		}
		h, err := r.store.ClaimHeads(ctx, r.cfg.BatchSize-len(claimed), token, r.heads.after, r.cfg.MaxInFlight)
		if err != nil {
			// The window's rows are claimed: deliver them, and walk
			// round the aggregates again at the next claim.
			r.logger.Warn("claim the heads of the aggregates; the next claim tries again", "error", err)
			break
		}
		claimed = append(claimed, h.Claimed...)
		r.heads.after = h.Last
		if h.Seen < r.cfg.MaxInFlight {
			// A whole round: every aggregate's head up to the newest
			// row when it began was looked at. The floor goes there at
			// once (a row below it whose transaction was still open
			// waits for the sweeper), so that the next claims walk only
			// the rows written since, not the backlog again.
			r.floor.saw(r.heads.newestAtTurn)
			r.floor.raise(r.heads.newestAtTurn)
			r.heads.after = outbox.AggregateKey{}
		}
	}
	sortRows(claimed)
	return claimed, token, backlog, nil
}

// minWaitingForNext is how many unpublished rows, beyond those claimed and
// in flight, make a claim that is not a full batch a backlog (claim).
const minWaitingForNext = 64

// analyzeEvery is how often, at most, the claim loop asks for fresh
// statistics of the outbox's ranges while a backlog lasts: about as often
// as autovacuum would look at them.
const analyzeEvery = time.Minute

// analyzeBurst asks Postgres, in the background, to analyze the ranges
// that hold the unpublished rows (those above the claim floor) and
// outbox_default, when a claim finds a backlog: a burst the statistics
// may not know of, or a claim slowed by statistics that do not know how
// the outbox grew (bench:backfill: a new database's outbox_default,
// analyzed nearly empty, autovacuum busy elsewhere; each claim scanned it
// once per row, for 15 to 50 s, the backlog staying inside the window).
// The planner knows each range by its last ANALYZE, and a
// range analyzed while nearly empty makes the claim sort every pending row
// of the range for each window, where a walk of the id index stops after
// it: in bench:relay's bigtx part, one transaction of 300,000 events over
// as many aggregates drained at 0.64 of the same rows committed in
// transactions of 1000 (those had been analyzed), and at 0.9 and more with
// this. Autovacuum analyzes such a range too, but only a minute or so
// later. The statement (fanout_outbox_analyze, migration 00018) skips a
// range whose lock another session holds; an error costs nothing but the
// statistics, so it is logged and the next burst asks again.
func (r *Relay) analyzeBurst(ctx context.Context) { r.analyzeRanges(ctx, analyzeEvery) }

// slowTxClaim is how long a claim of transactions takes before the relay
// asks for fresh statistics, at most every analyzeSlowEvery. The lookups
// of a transaction's rows plan on them: with a range analyzed while
// nearly empty, its unsent index counted as one entry, and a claim walked
// all of it once per candidate (in bench:relay's held horizon with
// relay.atomic transaction, claims grew from 0.5 s to 10 s in the minute
// before the next analyze, and the relay published 20 events/s of 1000).
const (
	slowTxClaim      = 200 * time.Millisecond
	analyzeSlowEvery = 10 * time.Second
)

// analyzeRanges asks for the statistics of the outbox's ranges holding the
// unpublished rows, unless it did less than every ago.
func (r *Relay) analyzeRanges(ctx context.Context, every time.Duration) {
	if time.Since(r.analyzedAt) < every {
		return
	}
	r.analyzedAt = time.Now()
	from := r.floor.after.Load()
	r.loops.Add(1)
	go func() {
		defer r.loops.Done()
		ctx, cancel := context.WithTimeout(ctx, analyzeTimeout)
		defer cancel()
		go func() { // a stopping relay waits for no statistics
			select {
			case <-r.stopping:
				cancel()
			case <-ctx.Done():
			}
		}()
		start := time.Now()
		n, err := r.store.AnalyzeRanges(ctx, from)
		if err != nil {
			r.logger.Warn("analyze the outbox's ranges after a burst; the next backlog asks again", "error", err)
			return
		}
		r.logger.Debug("analyzed the outbox's ranges holding a backlog", "ranges", n, "above_id", from, "took", time.Since(start).Round(time.Millisecond))
	}()
}

// analyzeTimeout bounds analyzeBurst's statement: ANALYZE reads a sample
// of 30,000 rows per range, well under a second for any range size.
const analyzeTimeout = 30 * time.Second

// sweepWindow is how many unpublished rows below the floor one sweep walks
// at most: a large backlog of events waiting for the one before them
// (per-aggregate order) is walked a window a sweep, round and round,
// rather than all of it every second, and a sweep whose window is full
// also walks round the aggregates (sweepHeads). A backlog smaller than the
// window, the usual case, is walked whole by every sweep.
func (r *Relay) sweepWindow() int {
	if r.testSweepWindow > 0 {
		return r.testSweepWindow
	}
	return max(2*r.cfg.BatchSize, 2_000)
}

// sweepLoop claims the rows at or below the floor every fullClaimEvery.
// It runs beside the claim loop, so that its walk from the lowest id,
// slow under a held snapshot, holds up none of the newest rows.
func (r *Relay) sweepLoop(softCtx, hardCtx context.Context) {
	t := time.NewTicker(fullClaimEvery)
	defer t.Stop()
	cursor := int64(math.MinInt64)
	for {
		select {
		case <-r.stopping:
			return
		case <-softCtx.Done():
			return
		case <-t.C:
		}
		newest := r.floor.newest.Load()
		next, ok := r.sweep(softCtx, hardCtx, cursor)
		if !ok {
			continue // the floor stays until a sweep completes
		}
		cursor = next
		r.floor.swept(newest)
	}
}

// sweep claims and delivers every due row at or below the floor in the
// window above from (sweepWindow); it returns where the next sweep starts
// (the lowest id again once a window reached the floor), or false if it
// could not finish (NATS or Postgres unreachable, a stop), leaving the
// window to the next one. Its first claim finds the window's end in the
// same statement (ClaimWindow). That is still two walks over the rows
// below the floor, and under a held snapshot each steps over every row
// published since it was taken (docs/design.md, "Under a held snapshot").
func (r *Relay) sweep(softCtx, hardCtx context.Context, from int64) (int64, bool) {
	floor := r.floor.after.Load()
	if from >= floor {
		from = math.MinInt64
	}
	batch := int64(r.cfg.BatchSize)
	through, inside := floor, false
	for after, first := from, true; ; first = false {
		if !r.nc.IsConnected() {
			return from, false
		}
		if err := r.slots.Acquire(softCtx, batch); err != nil {
			return from, false
		}
		token := newLeaseToken()
		start := time.Now()
		var rows []row
		var err error
		if first {
			// On hardCtx, as the claim loop's: a claim cancelled after the
			// server committed would strand its rows until their lease ends.
			var w outbox.Window
			if w, err = r.store.ClaimWindow(hardCtx, r.cfg.BatchSize, token, after, floor, r.sweepWindow()); err == nil {
				rows = w.Claimed
				if w.Full {
					through, inside = w.End, true
				}
			}
		} else {
			rows, err = r.store.ClaimRange(hardCtx, r.cfg.BatchSize, token, after, through)
		}
		r.slots.Release(batch - int64(len(rows)))
		if err != nil {
			r.logger.Warn("claim the rows below the claim floor; the next sweep tries again", "error", err, "floor", floor)
			return from, false
		}
		if len(rows) == 0 {
			break
		}
		r.obs.Claimed(len(rows), time.Since(start))
		sortRows(rows)
		// The claim picked the lowest ids it could take: the rows it
		// walked past below the last are not claimable now.
		after = rows[len(rows)-1].ID
		r.deliverAsync(hardCtx, rows, token, true)
		if len(rows) < r.cfg.BatchSize {
			break
		}
	}
	if inside && !r.hooks.Unordered && !r.sweepHeads(softCtx, hardCtx) {
		return from, false
	}
	if through >= floor {
		return math.MinInt64, true
	}
	return through, true
}

// sweepHeads is the sweeper's walk round the aggregates, a claim's worth
// of them a sweep (see claim): below a floor with more rows than a window
// (a backlog of events waiting for the one before them), the heads a sweep
// is there for (a lease reaped, a backoff over, a late commit) are found
// in as many sweeps as it takes to go round the aggregates, not round the
// backlog's rows. It returns false if it could not claim.
func (r *Relay) sweepHeads(softCtx, hardCtx context.Context) bool {
	batch := int64(r.cfg.BatchSize)
	if !r.nc.IsConnected() {
		return false
	}
	if err := r.slots.Acquire(softCtx, batch); err != nil {
		return false
	}
	token := newLeaseToken()
	start := time.Now()
	h, err := r.store.ClaimHeads(hardCtx, r.cfg.BatchSize, token, r.sweptHeads, r.cfg.MaxInFlight)
	r.slots.Release(batch - int64(len(h.Claimed)))
	if err != nil {
		r.logger.Warn("claim the heads of the aggregates below the claim floor; the next sweep tries again", "error", err)
		return false
	}
	r.sweptHeads = h.Last
	if h.Seen < r.cfg.MaxInFlight {
		r.sweptHeads = outbox.AggregateKey{}
	}
	if len(h.Claimed) > 0 {
		r.obs.Claimed(len(h.Claimed), time.Since(start))
		sortRows(h.Claimed)
		r.deliverAsync(hardCtx, h.Claimed, token, true)
	}
	return true
}

// sortRows orders a claimed batch by id, so one relay publishes in id order.
func sortRows(rows []row) {
	slices.SortFunc(rows, func(a, b row) int { return cmp.Compare(a.ID, b.ID) })
}
