package subscribers

import (
	"context"

	"github.com/fanout/fanout/subscribers/bookkeeping"
)

// HandleOnce runs the subscriber's handler on one event outside the
// consumer, with the same checkpoint semantics (operators redriving a dead
// letter use it): an event already in the checkpoint is not handled again
// and handled is false.
func (r *Runner) HandleOnce(ctx context.Context, ev Event) (handled bool, err error) {
	// An ordered subscriber's event must be its aggregate's next (a held
	// aggregate's holder first); one its aggregate moved past is applied
	// where the operator says so, its checkpoint left as it is.
	d := &delivery{ev: ev, hasRow: true, order: orderInfo{lateOK: true}}
	if err := r.origins.keyEvents(ctx, []*delivery{d}); err != nil {
		return false, err
	}
	ev = d.ev
	if r.call.txH != nil {
		fresh, err := r.txBatch(ctx, []*delivery{d})
		return len(fresh) == 1, err
	}
	done, err := r.store.CheckpointExists(ctx, bookkeeping.CheckpointKeyParams{Subscriber: r.name, EventID: ev.key()})
	if err != nil {
		return false, err
	}
	if done {
		return false, nil
	}
	if err := r.call.event(ctx, ev); err != nil {
		return false, err
	}
	err = r.checkpoint(ctx, []*delivery{d}, []int64{ev.key()})
	return err == nil, err
}
