package fulfilment_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
)

// stuckOn is the fulfilment handler, stuck on one event until its
// context ends: the instance dies holding it.
type stuckOn struct {
	fulfilment.Handler
	id   int64
	once *sync.Once
	in   chan struct{}
}

func (s stuckOn) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	if ev.ID == s.id {
		s.once.Do(func() { close(s.in) })
		<-ctx.Done()
		return ctx.Err()
	}
	return s.Handler.HandleTx(ctx, tx, ev)
}

// An ordered subscriber started from new events: its pinned instance dies
// holding an order's first event, and the order's second is published
// meanwhile. The standby that takes the pin applies them in order.
// JetStream redelivers the first only after the ack wait, so the pin must
// not move before then (subscribers.pinned_ttl longer than ack_wait):
// otherwise the standby sees the second first, takes it for the first it
// may see of an order from before its start, and applies it out of order.
func TestOrderHoldsAcrossAPinMoveAfterAStartNew(t *testing.T) {
	t.Parallel()
	env, _ := newEnv(t)
	env.Config.Subscribers.AckWait = 4 * time.Second
	env.Config.Subscribers.HandlerTimeout = 3 * time.Second
	env.Config.Subscribers.PinnedTTL = 0 // ack_wait and 5s more (3s, shorter than the ack wait, failed: the second applied first, the first refused as late)
	fromNew := func(o *subscribers.Options) { o.Config.Start = "new" }
	const warmOrder, order = 717171, 727272
	const warmID, firstID, secondID = 7100001, 7200001, 7200002

	dying := env.Connect()
	in := make(chan struct{})
	a := env.NewRunner(subscribertest.HandledBy(fulfilment.Subscriber, subscribers.Tx(stuckOn{id: firstID, once: &sync.Once{}, in: in})),
		func(o *subscribers.Options) { fromNew(o); o.Conn = dying })
	env.Start(a)
	// The first instance is pinned: it handles an order of its own before
	// the standby starts.
	publishOrderEvent(t, env, warmOrder, warmID, 1, shop.OrderCreated, `{"order_id": 717171, "customer": "warm", "lines": 1}`)
	ctx := context.Background()
	checkpointed := func(ids ...int64) func() (bool, string) {
		return func() (bool, string) {
			done, err := bookkeeping.New(env.DB.Pool).CheckpointList(ctx, bookkeeping.CheckpointParams{Subscriber: fulfilment.Name, EventIDs: ids})
			return err == nil && len(done) == len(ids), fmt.Sprintf("%v of %v (%v)", done, ids, err)
		}
	}
	subscribertest.WaitFor(t, 30*time.Second, "the pinned instance's first order", checkpointed(warmID))
	env.StartRunner(fulfilment.Subscriber, fromNew)

	publishOrderEvent(t, env, order, firstID, 1, shop.OrderCreated, `{"order_id": 727272, "customer": "pin", "lines": 1}`)
	select {
	case <-in:
	case <-time.After(30 * time.Second):
		t.Fatal("the pinned instance never took the order's first event")
	}
	dying.Close() // dies holding it
	dead, cancel := context.WithCancel(ctx)
	cancel()
	_ = a.Stop(dead)
	publishOrderEvent(t, env, order, secondID, 2, shop.OrderPaid, `{"order_id": 727272, "from": "created", "to": "paid", "n": 2}`)

	subscribertest.WaitFor(t, time.Minute, "both events of the order checkpointed by the standby", checkpointed(firstID, secondID))
	var violations []string
	rows, err := env.DB.Pool.Query(ctx, `SELECT event_id || ': ' || reason FROM fulfilment_violations WHERE order_id = $1`, order)
	if err != nil {
		t.Fatal(err)
	}
	if violations, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(violations) > 0 {
		t.Errorf("the order's events across the pin move: violations %v, want none (applied in order)", violations)
	}
}
