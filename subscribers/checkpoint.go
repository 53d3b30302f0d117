package subscribers

// Pruning the checkpoint: its rows of events the stream no longer holds
// (past stream.max_age) can never be needed again.

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/fanout/fanout/subscribers/bookkeeping"
)

// pruneInterval is how often each instance prunes (with jitter).
const pruneInterval = 10 * time.Minute

// pruner prunes one subscriber's rows.
type pruner struct {
	store  bookkeeping.Store
	name   string
	maxAge time.Duration // stream.max_age
	logger *slog.Logger
}

func (p *pruner) loop(ctx context.Context) {
	for {
		wait := pruneInterval/2 + rand.N(pruneInterval)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if n, err := p.prune(ctx); err != nil && ctx.Err() == nil {
			p.logger.Warn("prune checkpoint", "error", err)
		} else if n > 0 {
			p.logger.Info("pruned checkpoint", "rows", n)
		}
	}
}

// Prune deletes the subscriber's checkpoint rows older than the stream's
// max age and returns how many.
func (r *Runner) Prune(ctx context.Context) (int64, error) { return r.pruner.prune(ctx) }

func (p *pruner) prune(ctx context.Context) (int64, error) {
	params := bookkeeping.PruneParams{Subscriber: p.name, OlderThan: p.maxAge}
	var total int64
	for ctx.Err() == nil {
		n, err := p.store.CheckpointPrune(ctx, params)
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
	if err := p.store.AttemptPrune(ctx, params); err != nil {
		return total, err
	}
	return total, ctx.Err()
}
