package relay

import (
	"cmp"
	"context"
	"crypto/rand"
	"math"
	"slices"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/outboxstore"
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

// claimRound is what one claim took: n rows (their slots stay held, and
// deliver starts their delivery), or none, and then whether the claim's
// walk round a backlog goes on at once rather than backing off.
type claimRound struct {
	n       int
	walkOn  bool
	deliver func()
}

// runClaims is the claim loop of poll capture and of a wal relay's
// backlog of transactions: it claims (claim, under a new lease) as soon
// as batch rows fit in flight (relay.max_in_flight), hands what it took
// to a delivery of its own, backs off while claims find nothing or fail,
// and ends when the relay stops, or when a claim found nothing and
// finished (if set) says the work is done.
func (c *core) runClaims(softCtx context.Context, what string, batch int64,
	claim func(token pgtype.UUID) (claimRound, error), finished func() bool) {
	idle := eagerPollMin
	errWait := eagerPollMin
	for {
		if c.isStopping() {
			return
		}
		if !c.nc.IsConnected() {
			// Claiming now would only burn attempts; rows wait as pending.
			if !c.sleep(softCtx, c.cfg.PollInterval) {
				return
			}
			continue
		}
		if err := c.slots.Acquire(softCtx, batch); err != nil {
			return
		}
		start := time.Now()
		round, err := claim(newLeaseToken())
		if err != nil {
			c.slots.Release(batch)
			if !c.claimFailed(softCtx, what, err, &errWait) {
				return
			}
			continue
		}
		errWait = eagerPollMin
		c.touch()
		c.slots.Release(batch - int64(round.n))
		if round.n == 0 {
			if round.walkOn {
				continue
			}
			if finished != nil && finished() {
				return
			}
			if !c.sleep(softCtx, idle) {
				return
			}
			idle = min(idle*2, c.cfg.PollInterval)
			continue
		}
		c.obs.Claimed(round.n, time.Since(start))
		idle = eagerPollMin
		round.deliver()
	}
}

// claimEvents is the poll relay's claim loop with relay.atomic event: it
// claims a batch of rows (claim) and hands it to a delivery of its own
// (delivery.deliverAsync), beside the sweeper, which claims the rows
// below the claim floor.
func (r *Relay) claimEvents(softCtx, hardCtx context.Context) {
	// After wal capture, rows its relays published are still pending:
	// they must be told apart before the first claim (handover.go).
	if !r.wal.waitHandover(softCtx, hardCtx) {
		return
	}
	r.loops.Go(func() { r.sweeper.run(softCtx, hardCtx) })
	r.runClaims(softCtx, "claim outbox batch", int64(r.cfg.BatchSize), func(token pgtype.UUID) (claimRound, error) {
		// The claim runs on hardCtx: cancelling it after the server
		// committed would strand the claimed rows until their lease expires.
		rows, backlog, err := r.claim(hardCtx, token)
		return claimRound{n: len(rows), deliver: func() { r.delivery.deliverAsync(hardCtx, rows, token, backlog) }}, err
	}, nil)
}

// row is one claimed outbox row.
type row = outboxstore.Claimed

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
	after        outboxstore.AggregateKey
	newestAtTurn int64
}

// claim claims the claim loop's next batch. backlog says whether rows
// wait beyond it (a full batch, or a full window): only then do its
// deliveries go on with the next events of the aggregates they publish
// (ClaimNext). Otherwise the next events are new rows, which the next
// claims find; claiming after every small batch, mostly in vain, cost more
// than the claims themselves at a steady 1000 writes/s (bench:relay's held
// horizon: 35,671 such claims in three minutes took 11,533 rows).
func (r *Relay) claim(ctx context.Context, token pgtype.UUID) (_ []row, backlog bool, _ error) {
	// Nothing is decoded in the claim: message() judges each row on its
	// own, and a bad row becomes `failed`.
	w, err := r.store.ClaimRows(ctx, outboxstore.RowsClaim{N: r.cfg.BatchSize, Token: token, After: r.floor.after.Load(), Through: math.MaxInt64, Window: r.cfg.claimWindow()})
	if err != nil {
		return nil, false, err
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
		r.stats.burst(ctx)
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
		if r.heads.after == (outboxstore.AggregateKey{}) {
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
			r.heads.after = outboxstore.AggregateKey{}
		}
	}
	sortRows(claimed)
	return claimed, backlog, nil
}

// minWaitingForNext is how many unpublished rows, beyond those claimed and
// in flight, make a claim that is not a full batch a backlog (claim).
const minWaitingForNext = 64

// sortRows orders a claimed batch by id, so one relay publishes in id order.
func sortRows(rows []row) {
	slices.SortFunc(rows, func(a, b row) int { return cmp.Compare(a.ID, b.ID) })
}
