package subscribers

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
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

// attempts keeps those counts for one runner.
type attempts struct {
	store   bookkeeping.Store
	name    string
	timeout time.Duration // subscribers.handler_timeout: see bounded
	logger  *slog.Logger
	// crashed is the runner's: a runner whose process is taken for dead
	// (tests) writes nothing more.
	crashed *atomic.Bool
}

// bounded bounds a statement of the runtime's own (by
// subscribers.handler_timeout): a Postgres that stops answering
// mid-statement (a network that drops packets) must become an outage, not
// a worker stuck until the kernel gives up on the socket.
func bounded(ctx context.Context, cfg Config) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, cfg.HandlerTimeout)
}

// lookup reads, for the redelivered events ids, whether each is in the
// checkpoint and what its attempts were.
func (a *attempts) lookup(ctx context.Context, ids []int64) (map[int64]bookkeeping.AttemptState, error) {
	ctx, cancel := context.WithTimeout(ctx, a.timeout)
	defer cancel()
	out, err := a.store.AttemptList(ctx, bookkeeping.CheckpointParams{Subscriber: a.name, EventIDs: ids})
	if err != nil {
		return nil, fmt.Errorf("read the checkpoint and attempts: %w", err)
	}
	return out, nil
}

// open records that the handling of the redeliveries among ds begins (an
// attempt already open, held through an outage, stays as is).
func (a *attempts) open(ctx context.Context, ds []*delivery) error {
	var opening []*delivery
	for _, d := range ds {
		if d.mark && !d.opened {
			opening = append(opening, d)
		}
	}
	if len(opening) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, a.timeout)
	defer cancel()
	if err := a.store.AttemptOpen(ctx, bookkeeping.CheckpointParams{Subscriber: a.name, EventIDs: eventIDs(opening)}); err != nil {
		return fmt.Errorf("record attempts: %w", err)
	}
	for _, d := range opening {
		d.opened, d.hasRow = true, true
	}
	return nil
}

// close records that the open attempts of ds ended without an outcome
// worth counting (an outage, a snooze, a stop), and reports whether none
// is left open. Best effort: an attempt that cannot be closed stays open;
// this process knows it is its own while it holds the delivery, but if the
// process stops or dies first, it counts as one crash.
func (a *attempts) close(ds []*delivery) bool {
	if a.crashed.Load() {
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
	if err := a.store.AttemptClose(ctx, bookkeeping.CheckpointParams{Subscriber: a.name, EventIDs: eventIDs(open)}); err != nil {
		a.logger.Debug("close attempts (each stays open, and counts as a crash if this process lets its event go)", "error", err)
		return false
	}
	for _, d := range open {
		d.opened = false
	}
	return true
}

// fail counts a failure of the handler on d's event and returns the
// failures so far.
func (a *attempts) fail(ctx context.Context, d *delivery, cause error) (int, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	failures, err := a.store.AttemptFail(ctx, bookkeeping.AttemptFailParams{
		Subscriber: a.name, EventID: d.ev.key(), Error: truncate(cause.Error(), 2000), Closing: d.opened})
	if err != nil {
		return 0, fmt.Errorf("record the failure: %w", err)
	}
	d.opened, d.hasRow = false, true
	return failures, nil
}

// forget deletes the rows of events that are done with (handled, skipped
// or dead-lettered), best effort: pruning removes what is left.
func (a *attempts) forget(ctx context.Context, ds []*delivery) {
	ids := rowIDs(ds)
	if len(ids) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := a.store.AttemptDelete(ctx, bookkeeping.CheckpointParams{Subscriber: a.name, EventIDs: ids}); err != nil {
		a.logger.Debug("forget attempts (pruning will)", "error", err)
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
