package relay

import (
	"context"
	"time"
)

// rangeStats keeps the planner's statistics of the outbox's ranges
// current while a backlog lasts: the claims plan on them (see burst).
// Only the claim loop asks, so analyzedAt needs no lock.
type rangeStats struct {
	*core
	floor      *claimFloor // the ranges above it hold the backlog
	analyzedAt time.Time   // when the claim loop last asked
}

// analyzeEvery is how often, at most, the claim loop asks for fresh
// statistics of the outbox's ranges while a backlog lasts: about as often
// as autovacuum would look at them.
const analyzeEvery = time.Minute

// burst asks Postgres, in the background, to analyze the ranges
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
func (s *rangeStats) burst(ctx context.Context) { s.refresh(ctx, analyzeEvery) }

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

// refresh asks for the statistics of the outbox's ranges holding the
// unpublished rows, unless it did less than every ago.
func (s *rangeStats) refresh(ctx context.Context, every time.Duration) {
	if time.Since(s.analyzedAt) < every {
		return
	}
	s.analyzedAt = time.Now()
	from := s.floor.after.Load()
	s.loops.Add(1)
	go func() {
		defer s.loops.Done()
		ctx, cancel := context.WithTimeout(ctx, analyzeTimeout)
		defer cancel()
		go func() { // a stopping relay waits for no statistics
			select {
			case <-s.stopping:
				cancel()
			case <-ctx.Done():
			}
		}()
		start := time.Now()
		n, err := s.store.AnalyzeRanges(ctx, from)
		if err != nil {
			s.logger.Warn("analyze the outbox's ranges after a burst; the next backlog asks again", "error", err)
			return
		}
		s.logger.Debug("analyzed the outbox's ranges holding a backlog", "ranges", n, "above_id", from, "took", time.Since(start).Round(time.Millisecond))
	}()
}

// analyzeTimeout bounds burst's statement: ANALYZE reads a sample
// of 30,000 rows per range, well under a second for any range size.
const analyzeTimeout = 30 * time.Second
