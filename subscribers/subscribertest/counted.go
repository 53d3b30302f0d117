package subscribertest

import (
	"context"
	"encoding/json"
	"strconv"
	"sync"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
)

// Calls counts a handler's successful calls per event id.
type Calls struct {
	mu sync.Mutex
	n  map[int64]int
}

func (c *Calls) add(id int64) {
	c.mu.Lock()
	c.n[id]++
	c.mu.Unlock()
}

func (c *Calls) of(id int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

// Of is how many times the handler succeeded on event id.
func (c *Calls) Of(id int64) int { return c.of(id) }

// Counted wraps h so that its successful calls are counted.
func Counted(h subscribers.Handler) (subscribers.Handler, *Calls) { return counted(h) }

func counted(h subscribers.Handler) (subscribers.Handler, *Calls) {
	calls := &Calls{n: map[int64]int{}}
	if hh, ok := h.TxHandler(); ok {
		return subscribers.Tx(countedTx{hh, calls}), calls
	}
	if hh, ok := h.EventHandler(); ok {
		return subscribers.Each(countedEvent{hh, calls}), calls
	}
	return h, calls
}

type countedTx struct {
	subscribers.TxHandler
	calls *Calls
}

func (c countedTx) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	err := c.TxHandler.HandleTx(ctx, tx, ev)
	if err == nil {
		c.calls.add(ev.ID)
	}
	return err
}

type countedEvent struct {
	subscribers.EventHandler
	calls *Calls
}

func (c countedEvent) Handle(ctx context.Context, ev subscribers.Event) error {
	err := c.EventHandler.Handle(ctx, ev)
	if err == nil {
		c.calls.add(ev.ID)
	}
	return err
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func encodePayload(ev outbox.Event) ([]byte, error) {
	switch p := ev.Payload.(type) {
	case []byte:
		return p, nil
	case json.RawMessage:
		return p, nil
	}
	return json.Marshal(ev.Payload)
}

// Declare declares a test subscriber: its name, the event types it takes
// (subject patterns), and h, what its New builds. Set Ordered on the
// result for an ordered one.
func Declare(name string, h subscribers.Handler, eventTypes ...string) subscribers.Declaration {
	return HandledBy(subscribers.Declaration{Name: name, EventTypes: eventTypes}, h)
}

// HandledBy is d with h as what its New builds: a handler made with a
// test's own fixtures, or one wrapped (Counted).
func HandledBy(d subscribers.Declaration, h subscribers.Handler) subscribers.Declaration {
	d.New = func(subscribers.Deps) (subscribers.Handler, error) { return h, nil }
	return d
}
