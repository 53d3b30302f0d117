// Package fulfilment is an ordered subscriber: it follows each order's life
// (created, paid, shipped, delivered or cancelled) from the order.* events
// alone, applying each transition's payload to its own table, in order. It
// reads nothing of the shop's tables: what it knows of an order is what the
// events told it, in the order it got them.
//
// That makes it the witness of the ordered runtime. A transition that does
// not follow the one before it (its "from" is not the order's status as
// applied, or its number is not the next), one after the order ended, and
// one applied after a gap (an earlier event never arrived) are recorded in
// fulfilment_violations rather than applied. After any fault, every order's
// fulfilment_history must equal its order_transitions, and
// fulfilment_violations must be empty: the tests and the fault run check
// exactly that (Compare).
package fulfilment

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
)

// Name is the subscriber's durable name.
const Name = "fulfilment"

// Handler applies order transitions.
type Handler struct{}

// New returns the fulfilment handler.
func New() Handler { return Handler{} }

// Subscriber declares fulfilment to fanout.
var Subscriber = subscribers.Declaration{
	Name:       Name,
	EventTypes: []string{shop.OrderCreated, shop.OrderPaid, shop.OrderShipped, shop.OrderDelivered, shop.OrderCancelled},
	Ordered:    true,
	Grants: []string{
		"SELECT, INSERT, UPDATE ON fulfilment_orders",
		"SELECT, INSERT ON fulfilment_history, fulfilment_violations",
	},
	// Migration 00012_fulfilment.sql.
	Tables: []string{"fulfilment_history", "fulfilment_orders", "fulfilment_violations"},
	New:    func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Tx(New()), nil },
}

// ErrMalformed is why an event goes to the dead letters: its payload is
// not an order event.
var ErrMalformed = errors.New("malformed order event")

// HandleTx applies one event to its order, or records why it cannot.
func (Handler) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	t, err := transition(ev)
	if err != nil {
		return subscribers.Permanent(err)
	}
	var status *string
	var applied int
	err = tx.QueryRow(ctx, `SELECT status, applied FROM fulfilment_orders WHERE order_id = $1 FOR UPDATE`, t.OrderID).Scan(&status, &applied)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("read order %d: %w", t.OrderID, err)
	}
	var reason string
	switch {
	case ev.AfterGap:
		reason = fmt.Sprintf("applied after a gap: the events of its order before number %d did not all arrive", ev.AggregateSeq)
	case t.N != applied+1:
		reason = fmt.Sprintf("transition %d (%s → %s) out of order: %d applied before it", t.N, t.From, t.To, applied)
	case status != nil && (*status == shop.StatusDelivered || *status == shop.StatusCancelled):
		reason = fmt.Sprintf("transition %d (%s → %s) after the order ended %s", t.N, t.From, t.To, *status)
	case t.To != shop.StatusCreated && (status == nil || *status != t.From || !slices.Contains(shop.TransitionFrom[t.To], t.From)):
		reason = fmt.Sprintf("transition %d (%s → %s) does not follow the order's status (%s)", t.N, t.From, t.To, deref(status))
	}
	if reason != "" {
		_, err := tx.Exec(ctx, `INSERT INTO fulfilment_violations (order_id, event_id, event_type, reason) VALUES ($1, $2, $3, $4)`,
			t.OrderID, ev.ID, ev.Type, reason)
		if err != nil {
			return fmt.Errorf("record a violation of order %d: %w", t.OrderID, err)
		}
		return nil
	}
	b := &pgx.Batch{}
	b.Queue(`
INSERT INTO fulfilment_orders (order_id, status, applied) VALUES ($1, $2, $3)
ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, applied = excluded.applied, updated_at = now()`, t.OrderID, t.To, t.N)
	b.Queue(`INSERT INTO fulfilment_history (order_id, n, from_status, to_status, event_id) VALUES ($1, $2, $3, $4, $5)`,
		t.OrderID, t.N, nullable(t.From), t.To, ev.ID)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("apply transition %d of order %d: %w", t.N, t.OrderID, err)
	}
	return nil
}

// transition reads an event as its order's transition; order.created is
// the first (nothing → created).
func transition(ev subscribers.Event) (shop.OrderTransition, error) {
	var t shop.OrderTransition
	switch ev.Type {
	case shop.OrderCreated:
		var o shop.OrderEvent
		if err := json.Unmarshal(ev.Payload, &o); err != nil || o.OrderID <= 0 {
			return t, fmt.Errorf("%w: %s: %s", ErrMalformed, ev.Type, ev.Payload)
		}
		return shop.OrderTransition{OrderID: o.OrderID, To: shop.StatusCreated, N: 1}, nil
	case shop.OrderPaid, shop.OrderShipped, shop.OrderDelivered, shop.OrderCancelled:
		if err := json.Unmarshal(ev.Payload, &t); err != nil || t.OrderID <= 0 || t.N < 2 || "order."+t.To != ev.Type || t.From == "" {
			return t, fmt.Errorf("%w: %s: %s", ErrMalformed, ev.Type, ev.Payload)
		}
		return t, nil
	}
	return t, fmt.Errorf("%w: unexpected event type %s", ErrMalformed, ev.Type)
}

func deref(s *string) string {
	if s == nil {
		return "none: not created"
	}
	return *s
}

func nullable(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// Compare checks fulfilment against the shop: every order's applied
// history must equal its committed transitions, and no violation may be
// recorded. It returns what differs (at most limit lines), empty when all
// agree. orders limits it to some orders (nil: every order).
func Compare(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `
SELECT coalesce(t.order_id, h.order_id), coalesce(t.n, h.n),
       coalesce(t.from_status, '-') || '>' || t.to_status, coalesce(h.from_status, '-') || '>' || h.to_status
FROM order_transitions t
FULL JOIN fulfilment_history h ON h.order_id = t.order_id AND h.n = t.n
WHERE t.order_id IS NULL OR h.order_id IS NULL
   OR t.to_status <> h.to_status OR t.from_status IS DISTINCT FROM h.from_status
ORDER BY 1, 2
LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("compare histories: %w", err)
	}
	var diffs []string
	var order int64
	var n int
	var committed, applied *string
	_, err = pgx.ForEachRow(rows, []any{&order, &n, &committed, &applied}, func() error {
		diffs = append(diffs, fmt.Sprintf("order %d transition %d: committed %s, applied %s", order, n, orNone(committed), orNone(applied)))
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("compare histories: %w", err)
	}
	rows, err = q.Query(ctx, `SELECT order_id, event_id, event_type, reason FROM fulfilment_violations ORDER BY id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("read violations: %w", err)
	}
	var eventID int64
	var eventType, reason string
	_, err = pgx.ForEachRow(rows, []any{&order, &eventID, &eventType, &reason}, func() error {
		diffs = append(diffs, fmt.Sprintf("violation: order %d, event %d (%s): %s", order, eventID, eventType, reason))
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read violations: %w", err)
	}
	return diffs, nil
}

func orNone(s *string) string {
	if s == nil {
		return "nothing"
	}
	return *s
}
