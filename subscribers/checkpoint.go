package subscribers

// Pruning the checkpoint: its rows of events the stream no longer holds
// (past stream.max_age) can never be needed again.

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/fanout/fanout/subscribers/bookkeeping"
)

// pruneInterval is how often each instance prunes (with jitter).
const pruneInterval = 10 * time.Minute

func (r *Runner) pruneLoop(ctx context.Context) {
	for {
		wait := pruneInterval/2 + rand.N(pruneInterval)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if n, err := r.Prune(ctx); err != nil && ctx.Err() == nil {
			r.logger.Warn("prune checkpoint", "error", err)
		} else if n > 0 {
			r.logger.Info("pruned checkpoint", "rows", n)
		}
	}
}

// Prune deletes the subscriber's checkpoint rows older than the stream's
// max age and returns how many.
func (r *Runner) Prune(ctx context.Context) (int64, error) {
	p := bookkeeping.PruneParams{Subscriber: r.name, OlderThan: r.opts.Stream.MaxAge}
	var total int64
	for ctx.Err() == nil {
		n, err := r.store.CheckpointPrune(ctx, p)
		if err != nil {
			return total, err
		}
		total += n
		if n < bookkeeping.CheckpointPruneBatch {
			break
		}
	}
	// Attempt rows of events long gone from the stream (one whose event was
	// neither handled nor dead-lettered: its consumer was reset).
	if err := r.store.AttemptPrune(ctx, p); err != nil {
		return total, err
	}
	return total, ctx.Err()
}
