package relay

import (
	"context"
	"math"
	"time"

	"github.com/fanout/fanout/outboxstore"
)

// sweeper claims, once a second, the rows at or below the claim floor: a
// row reaped, backed off, retried by an operator, or committed by a
// transaction open longer than a second. It runs beside the claim loop,
// so that its slow walk under a held snapshot holds up none of the newest
// rows (relay/doc.go, "Claiming under a held snapshot").
type sweeper struct {
	*core
	delivery *delivery
	floor    *claimFloor
	after    outboxstore.AggregateKey // where the walk round the aggregates goes on (heads)
	// testWindow, when set, replaces window (tests walk a backlog below
	// the floor in windows of a few rows).
	testWindow int
}

// window is how many unpublished rows below the floor one sweep walks
// at most: a large backlog of events waiting for the one before them
// (per-aggregate order) is walked a window a sweep, round and round,
// rather than all of it every second, and a sweep whose window is full
// also walks round the aggregates (heads). A backlog smaller than the
// window, the usual case, is walked whole by every sweep.
func (s *sweeper) window() int {
	if s.testWindow > 0 {
		return s.testWindow
	}
	return max(2*s.cfg.BatchSize, 2_000)
}

// run claims the rows at or below the floor every fullClaimEvery.
// It runs beside the claim loop, so that its walk from the lowest id,
// slow under a held snapshot, holds up none of the newest rows.
func (s *sweeper) run(softCtx, hardCtx context.Context) {
	t := time.NewTicker(fullClaimEvery)
	defer t.Stop()
	cursor := int64(math.MinInt64)
	for {
		select {
		case <-s.stopping:
			return
		case <-softCtx.Done():
			return
		case <-t.C:
		}
		newest := s.floor.newest.Load()
		next, ok := s.sweep(softCtx, hardCtx, cursor)
		if !ok {
			continue // the floor stays until a sweep completes
		}
		cursor = next
		s.floor.swept(newest)
	}
}

// sweep claims and delivers every due row at or below the floor in the
// window above from (sweepWindow); it returns where the next sweep starts
// (the lowest id again once a window reached the floor), or false if it
// could not finish (NATS or Postgres unreachable, a stop), leaving the
// window to the next one. Its first claim finds the window's end in the
// same statement (a windowed ClaimRows). That is still two walks over the rows
// below the floor, and under a held snapshot each steps over every row
// published since it was taken (docs/design.md, "Under a held snapshot").
func (s *sweeper) sweep(softCtx, hardCtx context.Context, from int64) (int64, bool) {
	floor := s.floor.after.Load()
	if from >= floor {
		from = math.MinInt64
	}
	batch := int64(s.cfg.BatchSize)
	through, inside := floor, false
	for after, first := from, true; ; first = false {
		if !s.nc.IsConnected() {
			return from, false
		}
		if err := s.slots.Acquire(softCtx, batch); err != nil {
			return from, false
		}
		token := newLeaseToken()
		start := time.Now()
		// The first claim walks a window and finds its end (through is
		// still the floor); the next ones claim up to that end. On
		// hardCtx, as the claim loop's: a claim cancelled after the server
		// committed would strand its rows until their lease ends.
		c := outboxstore.RowsClaim{N: s.cfg.BatchSize, Token: token, After: after, Through: through}
		if first {
			c.Window = s.window()
		}
		w, err := s.store.ClaimRows(hardCtx, c)
		rows := w.Claimed
		if first && err == nil && w.Full {
			through, inside = w.End, true
		}
		s.slots.Release(batch - int64(len(rows)))
		if err != nil {
			s.logger.Warn("claim the rows below the claim floor; the next sweep tries again", "error", err, "floor", floor)
			return from, false
		}
		if len(rows) == 0 {
			break
		}
		s.obs.Claimed(len(rows), time.Since(start))
		sortRows(rows)
		// The claim picked the lowest ids it could take: the rows it
		// walked past below the last are not claimable now.
		after = rows[len(rows)-1].ID
		s.delivery.deliverAsync(hardCtx, rows, token, true)
		if len(rows) < s.cfg.BatchSize {
			break
		}
	}
	if inside && !s.hooks.Unordered && !s.heads(softCtx, hardCtx) {
		return from, false
	}
	if through >= floor {
		return math.MinInt64, true
	}
	return through, true
}

// heads is the sweeper's walk round the aggregates, a claim's worth
// of them a sweep (see claim): below a floor with more rows than a window
// (a backlog of events waiting for the one before them), the heads a sweep
// is there for (a lease reaped, a backoff over, a late commit) are found
// in as many sweeps as it takes to go round the aggregates, not round the
// backlog's rows. It returns false if it could not claim.
func (s *sweeper) heads(softCtx, hardCtx context.Context) bool {
	batch := int64(s.cfg.BatchSize)
	if !s.nc.IsConnected() {
		return false
	}
	if err := s.slots.Acquire(softCtx, batch); err != nil {
		return false
	}
	token := newLeaseToken()
	start := time.Now()
	h, err := s.store.ClaimHeads(hardCtx, s.cfg.BatchSize, token, s.after, s.cfg.MaxInFlight)
	s.slots.Release(batch - int64(len(h.Claimed)))
	if err != nil {
		s.logger.Warn("claim the heads of the aggregates below the claim floor; the next sweep tries again", "error", err)
		return false
	}
	s.after = h.Last
	if h.Seen < s.cfg.MaxInFlight {
		s.after = outboxstore.AggregateKey{}
	}
	if len(h.Claimed) > 0 {
		s.obs.Claimed(len(h.Claimed), time.Since(start))
		sortRows(h.Claimed)
		s.delivery.deliverAsync(hardCtx, h.Claimed, token, true)
	}
	return true
}
