package subscribers

// What becomes of each delivery: the handler's verdict judged, then ack,
// nak with backoff, or the dead letters.

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// handle runs the handler on the deliveries and records the successes.
func (r *Runner) handle(ctx context.Context, ds []*delivery) []result {
	if r.call.txH != nil {
		return r.handleTx(ctx, ds)
	}
	return r.handleEach(ctx, ds)
}

// result is what became of one delivery's attempt.
type result struct {
	kind  Outcome
	err   error
	delay time.Duration // for OutcomeSnooze
}

// judge classifies a failed attempt (Health.Judge), with the delay a
// snooze asked for.
func (r *Runner) judge(ctx context.Context, err error) result {
	res := result{kind: r.health.Judge(ctx, err), err: err}
	if res.kind == OutcomeSnooze {
		res.delay, _ = retryDelay(err)
	}
	return res
}

// settle gives each failed delivery its fate and returns those held.
func (r *Runner) settle(ctx context.Context, ds []*delivery, results []result) (held []*delivery) {
	// Attempts close before any nak: a redelivery that found its event's
	// attempt still open would take it for a crash.
	var closing []*delivery
	for i, d := range ds {
		switch results[i].kind {
		case OutcomeSnooze, OutcomeRetry, OutcomeOutage, OutcomeAbandoned:
			closing = append(closing, d)
		}
	}
	closed := r.attempts.close(closing)
	for i, d := range ds {
		res := results[i]
		switch res.kind {
		case OutcomeDone:
		case OutcomePermanent:
			d.deadReason = res.err.Error()
			var he *heldError
			if errors.As(res.err, &he) {
				d.heldBy = he.by
			}
			if !r.dead.send(ctx, d) {
				held = append(held, d)
			}
		case OutcomeFailed:
			failures, err := r.attempts.fail(ctx, d, res.err)
			if err != nil {
				// The failure cannot be counted: the store is down.
				held = append(held, r.heldBy(ctx, []*delivery{d}, err)...)
				continue
			}
			if failures >= r.cfg.MaxFailures {
				d.deadReason = fmt.Sprintf("gave up after %d failures (subscribers.max_failures): %v", failures, res.err)
				if !r.dead.send(ctx, d) {
					held = append(held, d)
				}
				continue
			}
			delay := r.cfg.Backoff(uint64(failures))
			r.nak(d, delay)
			r.logger.Warn("event failed, will retry", "event_id", d.ev.ID, "event_type", d.ev.Type,
				"failures", failures, "max_failures", r.cfg.MaxFailures, "retry_in", delay, "error", res.err)
		case OutcomeSnooze, OutcomeRetry:
			if !closed {
				// Naked with its attempt open, it would come back as a
				// suspect: wait for the store, then try again.
				held = append(held, r.heldBy(ctx, []*delivery{d}, errors.New("close the attempt: the checkpoint store does not answer"))...)
				continue
			}
			delay := res.delay
			if res.kind == OutcomeRetry {
				delay = r.cfg.Backoff(d.ev.Delivery)
				r.logger.Warn("event failed on a broken connection or a conflict with another transaction; retrying without counting it against the event",
					"event_id", d.ev.ID, "event_type", d.ev.Type, "retry_in", delay, "error", res.err)
			}
			r.nak(d, delay)
		case OutcomeOutage:
			held = append(held, d)
		case OutcomeAbandoned:
			// Hard stop: the failure is ours, not the event's. Left
			// unacked, it is redelivered after the ack wait.
		}
	}
	return held
}

func (r *Runner) nak(d *delivery, delay time.Duration) {
	for _, m := range d.msgs() {
		if err := m.NakWithDelay(delay); err != nil {
			r.logger.Warn("nak", "event_id", d.ev.ID, "error", err)
		}
	}
	d.settled.Store(true)
	d.fate.Store(fateNaked)
	d.nakDelay = delay
	r.stall.finished() // a verdict, if not a success: not a stall
	r.obs.Retried(r.name, 1)
}
