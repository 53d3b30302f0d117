// Package example is the template for a new subscriber, to copy (the steps:
// see the README's "Adding a subscriber").
//
// This one checks each new order (it exists and has lines) inside the
// transaction that records its checkpoint, and logs it. It is not in the
// shipped registry: binaries built with the fanout_example tag add it, which
// is how TestANewSubscriber proves that a package plus one registry line is
// all a subscriber needs.
package example

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
)

// Name is the durable consumer's name: never change it (a new name is a new
// subscriber that starts over).
const Name = "example"

// Subscriber is the declaration the registry lists.
var Subscriber = subscribers.Declaration{
	Name:       Name,
	EventTypes: []string{shop.OrderCreated},
	// Exactly the statements HandleTx runs; the role gets nothing else.
	Grants: []string{"SELECT ON orders, order_lines"},
	New: func(d subscribers.Deps) (subscribers.Handler, error) {
		return subscribers.Tx(&Handler{logger: d.Logger}), nil
	},
}

// ErrMalformed and ErrUnknownOrder are the reasons an event goes to the
// dead letters: the handler's own verdict, never an outage's.
var (
	ErrMalformed    = errors.New("malformed order.created payload")
	ErrUnknownOrder = errors.New("unknown order")
)

// Handler checks and logs new orders.
type Handler struct{ logger *slog.Logger }

// HandleTx runs in the transaction that also records the event's
// checkpoint: what it writes commits with the checkpoint or not at all. An
// error from Postgres is retried (and, while Postgres is down, waited out);
// subscribers.Permanent sends the event to the dead letters.
func (h *Handler) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	var p shop.OrderEvent
	if err := json.Unmarshal(ev.Payload, &p); err != nil || p.OrderID <= 0 {
		return subscribers.Permanent(fmt.Errorf("%w: %.200q", ErrMalformed, ev.Payload))
	}
	var lines int
	if err := tx.QueryRow(ctx, `SELECT count(l.*) FROM orders o LEFT JOIN order_lines l ON l.order_id = o.id WHERE o.id = $1 GROUP BY o.id`,
		p.OrderID).Scan(&lines); errors.Is(err, pgx.ErrNoRows) {
		return subscribers.Permanent(fmt.Errorf("%w %d", ErrUnknownOrder, p.OrderID))
	} else if err != nil {
		return err
	}
	h.logger.Info("order seen", "order_id", p.OrderID, "lines", lines, "event_id", ev.ID)
	return nil
}
