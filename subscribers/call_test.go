package subscribers

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

type panics struct{}

func (panics) Handle(context.Context, Event) error { panic("nil map") }

func (panics) HandleBatch(context.Context, []Event) []error { panic("nil map") }

type stuck struct{}

func (stuck) Handle(ctx context.Context, _ Event) error {
	<-ctx.Done()
	return ctx.Err()
}

type miscounts struct{ stuck }

func (miscounts) HandleBatch(context.Context, []Event) []error { return []error{nil} }

func deliveries(ids ...int64) []*delivery {
	ds := make([]*delivery, len(ids))
	for i, id := range ids {
		ds[i] = &delivery{ev: Event{ID: id, Type: "test.event"}}
	}
	return ds
}

// A call of the handler: a panic is the call's error, naming the event; a
// handler past its deadline says so, a stop does not; a batch handler that
// miscounts its outcomes fails every event of the batch.
func TestCallerTurnsPanicsAndDeadlinesIntoErrors(t *testing.T) {
	ctx := context.Background()
	c := caller{name: "test", eventH: panics{}, timeout: time.Second}
	if err := c.event(ctx, Event{ID: 7}); err == nil || !strings.Contains(err.Error(), "handler panicked on event 7: nil map") {
		t.Errorf("a panicking handler: %v", err)
	}
	for i, err := range c.each(ctx, deliveries(1, 2)) {
		if err == nil || !strings.Contains(err.Error(), "handler panicked on a batch") {
			t.Errorf("a panicking batch handler, event %d: %v", i, err)
		}
	}

	c = caller{name: "test", eventH: stuck{}, timeout: 50 * time.Millisecond}
	if err := c.event(ctx, Event{ID: 8}); err == nil || !strings.Contains(err.Error(), "subscribers.handler_timeout (50ms)") ||
		!errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a handler past its deadline: %v", err)
	}
	stop, cancel := context.WithCancel(ctx)
	cancel()
	if err := c.event(stop, Event{ID: 9}); err == nil || strings.Contains(err.Error(), "handler_timeout") {
		t.Errorf("a handler cut off by a stop: %v, want no word of its timeout", err)
	}

	c = caller{name: "test", eventH: miscounts{}, timeout: time.Second}
	for i, err := range c.each(ctx, deliveries(1, 2, 3)) {
		if err == nil || !strings.Contains(err.Error(), "1 outcomes for 3 events") {
			t.Errorf("a batch handler that miscounts, event %d: %v", i, err)
		}
	}
}
