package subscribers

import (
	"context"
	"fmt"

	"github.com/fanout/fanout/subscribers/bookkeeping"
)

// CountCheckpoints returns each subscriber's number of checkpoint rows
// (fanout status).
func CountCheckpoints(ctx context.Context, db bookkeeping.DB) (map[string]int64, error) {
	counts, err := bookkeeping.New(db).CheckpointCount(ctx)
	if err != nil {
		return nil, fmt.Errorf("count checkpoints: %w", err)
	}
	return counts, nil
}

// CountHeldAggregates returns, per ordered subscriber, how many aggregates
// are held behind a dead-lettered event (fanout status, and the metric
// fanout_subscriber_held_aggregates).
func CountHeldAggregates(ctx context.Context, db bookkeeping.DB) (map[string]int64, error) {
	counts, err := bookkeeping.New(db).AggregateCountHeld(ctx)
	if err != nil {
		return nil, fmt.Errorf("count held aggregates: %w", err)
	}
	return counts, nil
}
