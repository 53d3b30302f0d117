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
	return r.advance(ctx, tx, []*delivery{d}, map[int64]bool{ev.ID: true})
}
