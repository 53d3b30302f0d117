package subscribers

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Crash stops r as if its process had been killed: handlers are cut off
// and nothing more is written or acked.
func Crash(r *Runner) {
	r.crashed.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = r.Stop(ctx)
}

// Advance moves the per-aggregate checkpoint for one event in tx, as a
// worker of an ordered subscriber does once the dispatcher has judged the
// event its aggregate's next (the checkpoint must be at prev) or, with
// afterGap, given up waiting for the ones before it.
func Advance(ctx context.Context, r *Runner, tx pgx.Tx, ev Event, prev int64, afterGap bool) error {
	d := &delivery{ev: ev, order: orderInfo{prev: prev, afterGap: afterGap}}
	return r.aggregates.advance(ctx, tx, []*delivery{d}, map[int64]bool{ev.ID: true})
}

// AdvanceBatch moves the per-aggregate checkpoints of several events in
// one transaction, as a worker does with a batch: each event keyed first
// (its origin and id), each expected at prevs[i].
func AdvanceBatch(ctx context.Context, r *Runner, tx pgx.Tx, evs []Event, prevs []int64) error {
	ds := make([]*delivery, len(evs))
	for i, ev := range evs {
		ds[i] = &delivery{ev: ev, order: orderInfo{prev: prevs[i]}}
	}
	if err := r.origins.keyEvents(ctx, ds); err != nil {
		return err
	}
	fresh := map[int64]bool{}
	for _, d := range ds {
		fresh[d.ev.key()] = true
	}
	return r.aggregates.advance(ctx, tx, ds, fresh)
}
