package subscribers

// The per-event path: an EventHandler's effects live outside Postgres; the
// checkpoint follows each effect.

import (
	"context"
	"slices"
	"time"
)

// handleEach handles the batch's events (their effects are outside
// Postgres), then checkpoints the ones that succeeded.
func (r *Runner) handleEach(ctx context.Context, ds []*delivery) []result {
	start := time.Now()
	results := make([]result, len(ds))
	done, err := r.processed(ctx, eventIDs(ds))
	if err != nil {
		verdict := result{kind: OutcomeAbandoned, err: err}
		if ctx.Err() == nil {
			r.health.MarkDown(DependencyPostgres, err)
			verdict.kind = OutcomeOutage
		}
		for i := range results {
			results[i] = verdict
		}
		return results
	}
	skipped, todo, todoAt := unseen(ds, done)
	errs := r.call.each(ctx, todo)
	if _, batched := r.call.eventH.(BatchEventHandler); batched && sameFailure(errs) && r.judge(ctx, errs[0]).kind == OutcomeFailed {
		// A batch handler that failed as a whole may have failed on one of
		// its events: each is tried alone, so that one bad event is not
		// charged to all of them (as handleTx does).
		r.logger.Debug("batch failed as a whole, handling its events one by one", "events", len(todo), "error", errs[0])
		for j, d := range todo {
			errs[j] = r.call.event(ctx, d.ev)
		}
	}
	ok := slices.Clone(skipped)
	var handled []*delivery
	for j, d := range todo {
		if errs[j] != nil {
			results[todoAt[j]] = r.judge(ctx, errs[j])
			continue
		}
		ok = append(ok, d)
		handled = append(handled, d)
	}
	if len(handled) > 0 || len(skipped) > 0 {
		if err := r.checkpoint(ctx, handled, rowIDs(ok)); err != nil {
			// The effects happened; held, the (idempotent) handler runs
			// again once Postgres answers, and the checkpoint follows.
			kind := OutcomeAbandoned
			if ctx.Err() == nil {
				r.health.MarkDown(DependencyPostgres, err)
				kind = OutcomeOutage
			}
			return setResults(results, ds, ok, result{kind: kind, err: err})
		}
	}
	handledAt := time.Now() // checkpointed; the ack is not part of the stage
	r.beforeAck(ctx, ok)
	if ctx.Err() != nil {
		// Hard stop: the events come back after the ack wait.
		return setResults(results, ds, ok, result{kind: OutcomeAbandoned})
	}
	r.ack(ctx, ok, false)
	if len(handled) > 0 {
		r.health.HandlerWorked()
	}
	r.obs.Handled(r.name, len(handled), time.Since(start))
	r.timed(handled, eventIDs(handled), handledAt)
	r.logger.Debug("batch handled", "events", len(handled), "skipped", len(skipped), "redelivered", redelivered(ds), "took", time.Since(start))
	if len(skipped) > 0 {
		r.obs.Skipped(r.name, len(skipped))
	}
	return results
}

// unseen splits ds into the deliveries whose events are in the checkpoint
// already (done), and the others (todo), with their places in ds.
func unseen(ds []*delivery, done []int64) (skipped, todo []*delivery, todoAt []int) {
	seen := make(map[int64]bool, len(done))
	for _, id := range done {
		seen[id] = true
	}
	for i, d := range ds {
		if seen[d.ev.key()] {
			skipped = append(skipped, d)
			continue
		}
		todo = append(todo, d)
		todoAt = append(todoAt, i)
	}
	return skipped, todo, todoAt
}

// setResults gives res to the results of ds's deliveries among some.
func setResults(results []result, ds, some []*delivery, res result) []result {
	for i, d := range ds {
		if slices.Contains(some, d) {
			results[i] = res
		}
	}
	return results
}

// sameFailure reports whether a batch of more than one event failed as a
// whole: every event with the same error, and not an outage.
func sameFailure(errs []error) bool {
	if len(errs) < 2 || errs[0] == nil {
		return false
	}
	if _, down := IsUnavailable(errs[0]); down || IsPermanent(errs[0]) {
		return false
	}
	for _, err := range errs[1:] {
		if err == nil || err.Error() != errs[0].Error() {
			return false
		}
	}
	return true
}
