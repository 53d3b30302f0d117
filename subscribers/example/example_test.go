package example_test

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/example"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The template passes the conformance suite every subscriber must pass. Its
// effect is the line it logs for an order it checked: not idempotent by
// itself (a second handling logs again), so exactly once only through the
// checkpoint, which the suite proves by deleting it.
func TestConformance(t *testing.T) {
	logs := map[*subscribertest.Env]*syncbuf.Buffer{}
	var mu sync.Mutex
	subscribertest.Run(t, subscribertest.Case{
		Subscriber: example.Subscriber,
		Handler: func(env *subscribertest.Env) subscribers.Handler {
			buf := &syncbuf.Buffer{}
			mu.Lock()
			logs[env] = buf
			mu.Unlock()
			h, err := example.Subscriber.Build(subscribers.Deps{Context: context.Background(), Pool: env.DB.Pool,
				Logger: slog.New(slog.NewTextHandler(buf, nil))})
			if err != nil {
				env.T.Fatal(err)
			}
			return h
		},
		Valid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, error) {
			var orderID int64
			err := tx.QueryRow(context.Background(), `
WITH o AS (INSERT INTO orders (customer) VALUES ('test') RETURNING id),
     l AS (INSERT INTO order_lines (order_id, line_no, product_id, quantity, unit_price, sku, name)
           SELECT o.id, 1, 1, 1, 9.99, 'SKU-1', 'thing' FROM o)
SELECT id FROM o`).Scan(&orderID)
			return outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: strconv.FormatInt(orderID, 10), Type: shop.OrderCreated,
				Payload: shop.OrderEvent{OrderID: orderID, Customer: "test", Lines: 1}}, err
		},
		// The lines logged for this very event, naming its order.
		Effects: func(env *subscribertest.Env, ev outbox.Event, id int64) int {
			mu.Lock()
			buf := logs[env]
			mu.Unlock()
			n := 0
			for line := range strings.Lines(buf.String()) {
				f := strings.Fields(line)
				if slices.Contains(f, "event_id="+strconv.FormatInt(id, 10)) && slices.Contains(f, "order_id="+ev.AggregateID) {
					n++
				}
			}
			return n
		},
		Invalid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, string, error) {
			return outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: "x", Type: shop.OrderCreated,
				Payload: []byte(`{"order_id": "forty-two"}`)}, example.ErrMalformed.Error(), nil
		},
		CheckpointOnly: true,
	})
}

// An order that does not exist is the handler's verdict, not an outage: it
// goes to the dead letters.
func TestUnknownOrderIsDeadLettered(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	h, err := example.Subscriber.Build(subscribers.Deps{Context: context.Background(), Pool: env.DB.Pool, Logger: slog.Default()})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(context.Background(), env.DB.Pool, func(tx pgx.Tx) error {
		tx2, _ := h.TxHandler()
		return tx2.HandleTx(context.Background(), tx, subscribers.Event{ID: 1, Type: shop.OrderCreated,
			Payload: []byte(`{"order_id": 424242}`)})
	})
	if !subscribers.IsPermanent(err) || !strings.Contains(err.Error(), example.ErrUnknownOrder.Error()) {
		t.Fatalf("unknown order: %v, want a permanent %q", err, example.ErrUnknownOrder)
	}
}
