package subscribers

// The transactional path: a TxHandler's effects and the checkpoints of its
// batch commit in one transaction.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
)

// handleTx handles a batch in one transaction with its checkpoint rows; if
// the batch fails for anything but an outage, it rolls back and each event
// is handled alone, so one bad event never holds up the others.
func (r *Runner) handleTx(ctx context.Context, ds []*delivery) []result {
	results := make([]result, len(ds))
	start := time.Now()
	fresh, err := r.txBatch(ctx, ds)
	if err == nil {
		r.succeeded(ctx, ds, fresh, start)
		return results
	}
	verdict := r.judge(ctx, err)
	if len(ds) == 1 || verdict.kind == OutcomeOutage || verdict.kind == OutcomeAbandoned {
		for i := range results {
			results[i] = verdict
		}
		return results
	}
	r.logger.Debug("batch failed, handling its events one by one", "events", len(ds), "error", err)
	for i, d := range ds {
		one := []*delivery{d}
		fresh, err := r.txBatch(ctx, one)
		if err != nil {
			results[i] = r.judge(ctx, err)
			if k := results[i].kind; k == OutcomeOutage || k == OutcomeAbandoned {
				for j := i + 1; j < len(ds); j++ {
					results[j] = results[i]
				}
				break
			}
			continue
		}
		r.succeeded(ctx, one, fresh, time.Now())
	}
	return results
}

// txBatch runs the handler on the batch's new events in one transaction and
// returns their ids.
func (r *Runner) txBatch(ctx context.Context, ds []*delivery) (fresh []int64, err error) {
	ids := eventIDs(ds)
	forget := rowIDs(ds)
	// A hung handler must not hold its events forever (the in-progress
	// signals would keep them from being redelivered): bound the attempt.
	actx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout)
	defer cancel()
	tx, err := r.opts.Pool.Begin(actx)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	fresh, err = r.inTx(actx, tx, ds, ids, forget)
	if err == nil {
		if r.hooks.AckBeforeCommit > 0 {
			r.ack(ctx, ds, false)
			time.Sleep(r.hooks.AckBeforeCommit)
		}
		err = tx.Commit(actx)
	}
	err = r.call.timedOut(ctx, actx, err)
	var ee *eventError
	if errors.As(err, &ee) {
		err = ee.err
	}
	if err != nil {
		return nil, err
	}
	return fresh, nil
}

func (r *Runner) inTx(ctx context.Context, tx pgx.Tx, ds []*delivery, ids, forget []int64) (fresh []int64, err error) {
	store := bookkeeping.New(tx)
	newIDs, err := store.CheckpointClaim(ctx, bookkeeping.CheckpointParams{Subscriber: r.name, EventIDs: ids})
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	todo := make(map[int64]bool, len(newIDs))
	for _, id := range newIDs {
		todo[id] = true
	}
	if r.ordered && !r.hooks.Unordered {
		// Before the handler: the checkpoint's row lock keeps another
		// instance off the aggregate, and an event out of turn does no work.
		if err := r.aggregates.advance(ctx, tx, ds, todo); err != nil {
			return nil, err
		}
	}
	var evs []Event
	for _, d := range ds {
		if todo[d.ev.key()] {
			delete(todo, d.ev.key()) // a duplicate in the same batch runs once
			evs = append(evs, d.ev)
		}
	}
	if bh, ok := r.call.txH.(BatchTxHandler); ok && len(evs) > 1 {
		if err := r.call.batchTx(ctx, bh, tx, evs); err != nil {
			return nil, fmt.Errorf("batch of %d events: %w", len(evs), err)
		}
	} else {
		for _, ev := range evs {
			if err := r.call.tx(ctx, tx, ev); err != nil {
				return nil, &eventError{id: ev.ID, err: err}
			}
		}
	}
	if len(forget) > 0 {
		if err := store.AttemptDelete(ctx, bookkeeping.CheckpointParams{Subscriber: r.name, EventIDs: forget}); err != nil {
			return nil, fmt.Errorf("forget attempts: %w", err)
		}
	}
	return newIDs, nil
}

// eventError carries a handler's error out of the transaction unchanged.
type eventError struct {
	id  int64
	err error
}

func (e *eventError) Error() string { return fmt.Sprintf("event %d: %v", e.id, e.err) }
