package subscribers

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/fanout/fanout/subscribers/bookkeeping"
)

// The runtime's memory of events that did not go well the first time
// (table subscriber_attempts, see its migration). JetStream redelivers
// without limit (the consumer's max_deliver is -1), because its delivery
// count also counts deliveries lost to outages; the runtime decides from
// these rows when an event has had enough:
//
//   - failures: the handler failed on the event while every dependency
//     answered. At subscribers.max_failures the event is dead-lettered.
//   - open_attempts: each attempt on a redelivered event opens one before
//     the handler runs and closes it with the outcome. One still open when
//     the event arrives again belongs to a process that died handling it.
//     Such a suspect is handled alone, with every other worker of the
//     instance paused, so that a crash it causes is charged to it and not to
//     the events that happened to be in flight beside it. At
//     subscribers.max_crashes open attempts it is dead-lettered unhandled.
//
// First deliveries write nothing here, so the common path costs nothing:
// only failures and redeliveries do. The statements are bookkeeping.Store's
// Attempt* methods.

// bookkeeping bounds a statement of the runtime's own: a Postgres that
// stops answering mid-statement (a network that drops packets) must become
// an outage, not a worker stuck until the kernel gives up on the socket.
func (r *Runner) bookkeeping(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, r.cfg.HandlerTimeout)
}

func (r *Runner) lookupAttempts(ctx context.Context, ids []int64) (map[int64]bookkeeping.AttemptState, error) {
	ctx, cancel := r.bookkeeping(ctx)
	defer cancel()
	out, err := r.store.AttemptList(ctx, bookkeeping.CheckpointParams{Subscriber: r.name, EventIDs: ids})
	if err != nil {
		return nil, fmt.Errorf("read the checkpoint and attempts: %w", err)
	}
	return out, nil
}

// openAttempts records that the handling of the redeliveries among ds
// begins (an attempt already open, held through an outage, stays as is).
func (r *Runner) openAttempts(ctx context.Context, ds []*delivery) error {
	var opening []*delivery
	for _, d := range ds {
		if d.mark && !d.opened {
			opening = append(opening, d)
		}
	}
	if len(opening) == 0 {
		return nil
	}
	ctx, cancel := r.bookkeeping(ctx)
	defer cancel()
	if err := r.store.AttemptOpen(ctx, bookkeeping.CheckpointParams{Subscriber: r.name, EventIDs: eventIDs(opening)}); err != nil {
		return fmt.Errorf("record attempts: %w", err)
	}
	for _, d := range opening {
		d.opened, d.hasRow = true, true
	}
	return nil
}

// closeAttempts records that the open attempts of ds ended without an
// outcome worth counting (an outage, a snooze, a stop), and reports whether
// none is left open. Best effort: an attempt that cannot be closed stays
// open; this process knows it is its own while it holds the delivery, but if
// the process stops or dies first, it counts as one crash.
func (r *Runner) closeAttempts(ds []*delivery) bool {
	if r.crashed.Load() {
		return false
	}
	var open []*delivery
	for _, d := range ds {
		if d.opened {
			open = append(open, d)
		}
	}
	if len(open) == 0 {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := r.store.AttemptClose(ctx, bookkeeping.CheckpointParams{Subscriber: r.name, EventIDs: eventIDs(open)}); err != nil {
		r.logger.Debug("close attempts (each stays open, and counts as a crash if this process lets its event go)", "error", err)
		return false
	}
	for _, d := range open {
		d.opened = false
	}
	return true
}

// recordFailure counts a failure of the handler on d's event and returns
// the failures so far.
func (r *Runner) recordFailure(ctx context.Context, d *delivery, cause error) (int, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	failures, err := r.store.AttemptFail(ctx, bookkeeping.AttemptFailParams{
		Subscriber: r.name, EventID: d.ev.key(), Error: truncate(cause.Error(), 2000), Closing: d.opened})
	if err != nil {
		return 0, fmt.Errorf("record the failure: %w", err)
	}
	d.opened, d.hasRow = false, true
	return failures, nil
}

// forgetAttempts deletes the rows of events that are done with (handled,
// skipped or dead-lettered), best effort: pruning removes what is left.
func (r *Runner) forgetAttempts(ctx context.Context, ds []*delivery) {
	ids := rowIDs(ds)
	if len(ids) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := r.store.AttemptDelete(ctx, bookkeeping.CheckpointParams{Subscriber: r.name, EventIDs: ids}); err != nil {
		r.logger.Debug("forget attempts (pruning will)", "error", err)
	}
}

// rowIDs are the sorted event ids of the deliveries that may have an
// attempts row.
func rowIDs(ds []*delivery) []int64 {
	var ids []int64
	for _, d := range ds {
		if d.hasRow {
			ids = append(ids, d.ev.key())
		}
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// eventIDs are the sorted, distinct checkpoint keys of ds (origin.go).
func eventIDs(ds []*delivery) []int64 {
	ids := make([]int64, len(ds))
	for i, d := range ds {
		ids[i] = d.ev.key()
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}
