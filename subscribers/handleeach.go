package subscribers

// The per-event path: an EventHandler's effects live outside Postgres; the
// checkpoint follows each effect.

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"time"
)

// callEach runs the handler on each event: in one call for a
// BatchEventHandler, else one by one.
func (r *Runner) callEach(ctx context.Context, ds []*delivery) []error {
	errs := make([]error, len(ds))
	if len(ds) == 0 {
		return errs
	}
	if bh, ok := r.eventH.(BatchEventHandler); ok && len(ds) > 1 {
		evs := make([]Event, len(ds))
		for i, d := range ds {
			evs[i] = d.ev
		}
		func() {
			defer func() {
				if p := recover(); p != nil {
					for i := range errs {
						errs[i] = fmt.Errorf("handler panicked on a batch: %v\n%s", p, debug.Stack())
					}
				}
			}()
			hctx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout) // see txBatch
			defer cancel()
			sctx, span := r.batchContext(hctx, evs)
			defer span.End()
			got := bh.HandleBatch(sctx, evs)
			for i := range got {
				got[i] = r.timedOut(ctx, hctx, got[i])
			}
			if len(got) != len(errs) {
				err := fmt.Errorf("handler returned %d outcomes for %d events", len(got), len(errs))
				for i := range errs {
					errs[i] = err
				}
				return
			}
			copy(errs, got)
		}()
		return errs
	}
	for i, d := range ds {
		errs[i] = r.call(ctx, d.ev)
	}
	return errs
}

func (r *Runner) call(ctx context.Context, ev Event) (err error) {
	defer RecoverHandler(ev, &err)
	hctx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout) // see txBatch
	defer cancel()
	hctx, span := r.eventContext(hctx, ev)
	defer span.End()
	return r.timedOut(ctx, hctx, r.eventH.Handle(hctx, ev))
}

// timedOut says so when a handler's error comes from its own deadline
// (subscribers.handler_timeout) rather than from a stop.
func (r *Runner) timedOut(ctx, hctx context.Context, err error) error {
	if err != nil && ctx.Err() == nil && errors.Is(hctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("handler did not finish within subscribers.handler_timeout (%s): %w", r.cfg.HandlerTimeout, err)
	}
	return err
}

// RecoverHandler, deferred around a call of a handler on ev, makes the
// handler's panic the call's error (*err), naming the event, with its
// stack: for the live runtime and the backfill alike.
func RecoverHandler(ev Event, err *error) {
	if p := recover(); p != nil {
		*err = fmt.Errorf("handler panicked on event %d: %v\n%s", ev.ID, p, debug.Stack())
	}
}

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
	seen := make(map[int64]bool, len(ds))
	for _, id := range done {
		seen[id] = true
	}
	var ok, todo, skipped []*delivery
	var todoAt []int
	for i, d := range ds {
		if seen[d.ev.key()] {
			ok = append(ok, d)
			skipped = append(skipped, d)
			continue
		}
		todo = append(todo, d)
		todoAt = append(todoAt, i)
	}
	errs := r.callEach(ctx, todo)
	if _, batched := r.eventH.(BatchEventHandler); batched && sameFailure(errs) && r.judge(ctx, errs[0]).kind == OutcomeFailed {
		// A batch handler that failed as a whole may have failed on one of
		// its events: each is tried alone, so that one bad event is not
		// charged to all of them (as handleTx does).
		r.logger.Debug("batch failed as a whole, handling its events one by one", "events", len(todo), "error", errs[0])
		for j, d := range todo {
			errs[j] = r.call(ctx, d.ev)
		}
	}
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
			if ctx.Err() == nil {
				r.health.MarkDown(DependencyPostgres, err)
			}
			for i, d := range ds {
				if slices.Contains(ok, d) {
					results[i] = result{kind: OutcomeOutage, err: err}
					if ctx.Err() != nil {
						results[i].kind = OutcomeAbandoned
					}
				}
			}
			return results
		}
	}
	handledAt := time.Now() // checkpointed; the ack is not part of the stage
	r.beforeAck(ctx, ok)
	if ctx.Err() != nil {
		for i, d := range ds {
			if slices.Contains(ok, d) {
				results[i] = result{kind: OutcomeAbandoned}
			}
		}
		return results // hard stop: the events come back after the ack wait
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
