package subscribers

// Which deliveries run together, and which alone: an event whose
// earlier attempt died with its process is a suspect.

import (
	"context"
	"fmt"
)

// attempt tries the deliveries once and returns those held by an outage.
func (r *Runner) attempt(ctx context.Context, ds []*delivery) (held []*delivery) {
	var todo []*delivery
	for _, d := range ds {
		if d.deadReason == "" {
			todo = append(todo, d)
		} else if !r.dead.send(ctx, d) {
			held = append(held, d)
		}
	}
	normal, suspects, waiting := r.triage(ctx, todo)
	held = append(held, waiting...)
	if len(normal) > 0 {
		held = append(held, r.attemptTogether(ctx, normal)...)
	}
	for _, d := range suspects {
		held = append(held, r.attemptSuspect(ctx, d)...)
	}
	return held
}

// triage sorts the deliveries by what the runtime knows of their events.
// First deliveries go straight to the handler. A redelivered event may be
// in the checkpoint already (acked and skipped), may have worn out its
// failures or crashes (dead letter: the process died after deciding so),
// may be a suspect (an earlier attempt never ended: handled alone), or else
// is handled with the others, under an attempt of its own.
func (r *Runner) triage(ctx context.Context, ds []*delivery) (normal, suspects, held []*delivery) {
	var redelivered []int64
	for _, d := range ds {
		if d.ev.Delivery > 1 {
			redelivered = append(redelivered, d.ev.key())
		}
	}
	if len(redelivered) == 0 {
		return ds, nil, nil
	}
	states, err := r.attempts.lookup(ctx, redelivered)
	if err != nil {
		if ctx.Err() == nil {
			r.health.MarkDown(DependencyPostgres, err)
			return nil, nil, ds
		}
		r.attempts.close(ds)
		return nil, nil, nil
	}
	var skipped []*delivery
	for _, d := range ds {
		if d.ev.Delivery <= 1 {
			normal = append(normal, d)
			continue
		}
		st := states[d.ev.key()]
		d.hasRow, d.mark = st.HasRow, true
		died := st.OpenAttempts
		if d.opened {
			died-- // this process's own attempt, held through an outage: not a death
		}
		switch {
		case st.Done:
			skipped = append(skipped, d)
		case st.Failures >= r.cfg.MaxFailures:
			d.deadReason = fmt.Sprintf("gave up after %d failures (subscribers.max_failures): %s", st.Failures, st.LastError)
		case died >= r.cfg.MaxCrashes:
			d.deadReason = fmt.Sprintf("its handling never ended %d times: the process died each time (killed, out of memory, or a crash outside the handler), so it was not tried again (subscribers.max_crashes)", died)
		case died > 0:
			suspects = append(suspects, d)
		default:
			normal = append(normal, d)
		}
		if d.deadReason != "" && !r.dead.send(ctx, d) {
			held = append(held, d)
		}
	}
	if len(skipped) > 0 {
		r.attempts.close(skipped)
		r.ack(ctx, skipped, false)
		r.attempts.forget(ctx, skipped)
		r.obs.Skipped(r.name, len(skipped))
	}
	return normal, suspects, held
}

// attemptTogether handles deliveries side by side with the other workers'.
// Their attempts are opened only once no suspect runs alone: a suspect's
// crash must not be charged to events that had not started.
func (r *Runner) attemptTogether(ctx context.Context, ds []*delivery) (held []*delivery) {
	r.exclusive.RLock()
	if err := r.attempts.open(ctx, ds); err != nil {
		r.exclusive.RUnlock()
		return r.heldBy(ctx, ds, err)
	}
	results := r.handle(ctx, ds)
	r.exclusive.RUnlock()
	return r.settle(ctx, ds, results)
}

// attemptSuspect handles one suspect alone, every other worker paused.
func (r *Runner) attemptSuspect(ctx context.Context, d *delivery) (held []*delivery) {
	r.exclusive.Lock()
	defer r.exclusive.Unlock()
	one := []*delivery{d}
	if err := r.attempts.open(ctx, one); err != nil {
		return r.heldBy(ctx, one, err)
	}
	r.logger.Warn("handling an event alone: an earlier attempt on it never ended (its process died)", "event_id", d.ev.ID, "event_type", d.ev.Type, "delivery", d.ev.Delivery)
	return r.settle(ctx, one, r.handle(ctx, one))
}

// heldBy returns the deliveries held for a failed bookkeeping write: the
// checkpoint store is down (or the runner stops, and they are let go).
func (r *Runner) heldBy(ctx context.Context, ds []*delivery, err error) []*delivery {
	if ctx.Err() != nil {
		r.attempts.close(ds)
		return nil
	}
	r.health.MarkDown(DependencyPostgres, err)
	return ds
}
