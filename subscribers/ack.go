package subscribers

// Recording handled events in the checkpoint, and acking them.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/subscribers/bookkeeping"
	"golang.org/x/sync/errgroup"
)

// processed returns the ids among ids already in the checkpoint.
func (r *Runner) processed(ctx context.Context, ids []int64) ([]int64, error) {
	ctx, cancel := bounded(ctx, r.cfg)
	defer cancel()
	done, err := r.store.CheckpointList(ctx, bookkeeping.CheckpointParams{Subscriber: r.name, EventIDs: ids})
	if err != nil {
		return nil, fmt.Errorf("read the checkpoint: %w", err)
	}
	return done, nil
}

// checkpoint records handled events and forgets the attempts of every
// event done with, in one round trip (a batch runs as one implicit
// transaction).
func (r *Runner) checkpoint(ctx context.Context, handled []*delivery, forget []int64) error {
	ctx, cancel := bounded(ctx, r.cfg)
	defer cancel()
	return r.store.CheckpointRecord(ctx, bookkeeping.CheckpointRecordParams{Subscriber: r.name, Handled: eventIDs(handled), Forget: forget})
}

// succeeded acks a committed batch (double ack: the server confirms, so a
// lost ack cannot make JetStream redeliver behind our back unnoticed).
func (r *Runner) succeeded(ctx context.Context, ds []*delivery, freshIDs []int64, start time.Time) {
	handledAt := time.Now() // committed; the ack is not part of the stage
	r.beforeAck(ctx, ds)
	if ctx.Err() != nil {
		return // hard stop: the events come back after the ack wait, and are skipped
	}
	if r.hooks.AckBeforeCommit == 0 {
		r.ack(ctx, ds, true)
	}
	r.health.HandlerWorked()
	fresh := len(freshIDs)
	r.obs.Handled(r.name, fresh, time.Since(start))
	r.timed(ds, freshIDs, handledAt)
	r.logger.Debug("batch handled", "events", fresh, "skipped", len(ds)-fresh, "redelivered", redelivered(ds), "first_event_id", ds[0].ev.ID, "took", time.Since(start))
	if skipped := len(ds) - fresh; skipped > 0 {
		r.obs.Skipped(r.name, skipped)
	}
}

// redelivered counts the deliveries that were not an event's first.
func redelivered(ds []*delivery) int {
	n := 0
	for _, d := range ds {
		if d.ev.Delivery > 1 {
			n++
		}
	}
	return n
}

func (r *Runner) beforeAck(ctx context.Context, ds []*delivery) {
	if r.hooks.BeforeAck == nil || len(ds) == 0 {
		return
	}
	ids := make([]int64, len(ds))
	for i, d := range ds {
		ids[i] = d.ev.ID
	}
	r.hooks.BeforeAck(ctx, ids)
}

// ackParallelism bounds concurrent double acks: each is a round trip.
const ackParallelism = 64

func (r *Runner) ack(ctx context.Context, ds []*delivery, double bool) {
	var heldBack atomic.Int64
	defer func() {
		for _, d := range ds {
			d.settled.Store(true)
			d.fate.Store(fateAcked)
		}
		r.stall.finished()
		if n := heldBack.Load(); n > 0 {
			r.logger.Info("acks not sent: their messages came on an earlier connection to NATS (feed.go); JetStream redelivers them after the ack wait, and the checkpoint skips them then",
				"messages", n, "first_event_id", ds[0].ev.ID)
		}
	}()
	settle := func(d *delivery, err error) {
		switch {
		case errors.Is(err, errEarlierConnection):
			heldBack.Add(1)
		case err != nil:
			// The effect is committed with its checkpoint: a redelivery
			// will be skipped.
			r.logger.Warn("ack", "event_id", d.ev.ID, "double", double, "error", err)
		}
	}
	if !double {
		for _, d := range ds {
			for _, m := range d.msgs() {
				settle(d, m.Ack())
			}
		}
		return
	}
	g, gctx := errgroup.WithContext(context.WithoutCancel(ctx))
	g.SetLimit(ackParallelism)
	for _, d := range ds {
		for _, m := range d.msgs() {
			g.Go(func() error {
				actx, cancel := context.WithTimeout(gctx, 5*time.Second)
				defer cancel()
				settle(d, m.DoubleAck(actx))
				return nil
			})
		}
	}
	_ = g.Wait()
}

// timed reports the stage times of the deliveries that carried the events
// in ids (those just handled: a redelivery skipped as a duplicate was
// handled before, and timed then).
func (r *Runner) timed(ds []*delivery, ids []int64, handledAt time.Time) {
	if len(ids) == 0 {
		return
	}
	want := make(map[int64]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	ts := make([]EventTimes, 0, len(ids))
	for _, d := range ds {
		if want[d.ev.key()] {
			delete(want, d.ev.key())
			ts = append(ts, EventTimes{Committed: d.ev.CreatedAt, Stored: d.ev.StoredAt, Delivered: d.deliveredAt, Handled: handledAt})
		}
	}
	r.obs.Timed(r.name, ts)
}
