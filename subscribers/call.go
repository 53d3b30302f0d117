package subscribers

// Calling the subscriber's handler: bounded by subscribers.handler_timeout,
// in a span of the event's trace, a panic made the call's error.

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"
)

// caller calls one subscriber's handler, of the kind it was made. Each
// call is bounded by the timeout (a TxHandler's by its transaction's): a
// hung handler must not hold its events forever, since the in-progress
// signals would keep them from being redelivered.
type caller struct {
	name    string
	eventH  EventHandler
	txH     TxHandler
	timeout time.Duration // subscribers.handler_timeout
}

// each runs the handler on each event: in one call for a
// BatchEventHandler, else one by one.
func (c *caller) each(ctx context.Context, ds []*delivery) []error {
	errs := make([]error, len(ds))
	if len(ds) == 0 {
		return errs
	}
	if bh, ok := c.eventH.(BatchEventHandler); ok && len(ds) > 1 {
		evs := make([]Event, len(ds))
		for i, d := range ds {
			evs[i] = d.ev
		}
		func() {
			defer func() {
				if p := recover(); p != nil {
					for i := range errs {
						errs[i] = fmt.Errorf("handler panicked on a batch: %v\n%s", p, debug.Stack())
					}
				}
			}()
			hctx, cancel := context.WithTimeout(ctx, c.timeout)
			defer cancel()
			sctx, span := batchContext(hctx, c.name, evs)
			defer span.End()
			got := bh.HandleBatch(sctx, evs)
			for i := range got {
				got[i] = c.timedOut(ctx, hctx, got[i])
			}
			if len(got) != len(errs) {
				err := fmt.Errorf("handler returned %d outcomes for %d events", len(got), len(errs))
				for i := range errs {
					errs[i] = err
				}
				return
			}
			copy(errs, got)
		}()
		return errs
	}
	for i, d := range ds {
		errs[i] = c.event(ctx, d.ev)
	}
	return errs
}

// event runs an EventHandler on one event.
func (c *caller) event(ctx context.Context, ev Event) (err error) {
	defer RecoverHandler(ev, &err)
	hctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	hctx, span := eventContext(hctx, c.name, ev)
	defer span.End()
	return c.timedOut(ctx, hctx, c.eventH.Handle(hctx, ev))
}

// timedOut says so when a handler's error comes from its own deadline
// (subscribers.handler_timeout) rather than from a stop.
func (c *caller) timedOut(ctx, hctx context.Context, err error) error {
	if err != nil && ctx.Err() == nil && errors.Is(hctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("handler did not finish within subscribers.handler_timeout (%s): %w", c.timeout, err)
	}
	return err
}

// RecoverHandler, deferred around a call of a handler on ev, makes the
// handler's panic the call's error (*err), naming the event, with its
// stack: for the live runtime and the backfill alike.
func RecoverHandler(ev Event, err *error) {
	if p := recover(); p != nil {
		*err = fmt.Errorf("handler panicked on event %d: %v\n%s", ev.ID, p, debug.Stack())
	}
}

// tx runs a TxHandler on one event in tx (its deadline is the
// transaction's: see Runner.txBatch).
func (c *caller) tx(ctx context.Context, tx pgx.Tx, ev Event) (err error) {
	defer RecoverHandler(ev, &err)
	ctx, span := eventContext(ctx, c.name, ev)
	defer span.End()
	return c.txH.HandleTx(ctx, tx, ev)
}

// batchTx runs a BatchTxHandler on a batch's events in tx.
func (c *caller) batchTx(ctx context.Context, bh BatchTxHandler, tx pgx.Tx, evs []Event) (err error) {
	defer RecoverHandler(evs[0], &err)
	ctx, span := batchContext(ctx, c.name, evs)
	defer span.End()
	return bh.HandleBatchTx(ctx, tx, evs)
}
