package fulfilment_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
)

// Gaps in an order's numbers: waited for, then marked, and the first event
// a subscriber started from new events sees.

// publishOrderEvent puts an order's event straight into the stream, as
// the relay would have, with the headers the runtime reads.
func publishOrderEvent(t *testing.T, env *subscribertest.Env, order, id, seq int64, eventType, payload string) {
	t.Helper()
	m := nats.NewMsg(env.Config.Stream.SubjectPrefix + "." + eventType)
	m.Header.Set(wire.EventIDHeader, strconv.FormatInt(id, 10))
	m.Header.Set(wire.EventTypeHeader, eventType)
	m.Header.Set(wire.AggregateTypeHeader, shop.AggregateOrder)
	m.Header.Set(wire.AggregateIDHeader, strconv.FormatInt(order, 10))
	m.Header.Set(wire.AggregateSeqHeader, strconv.FormatInt(seq, 10))
	m.Data = []byte(payload)
	if _, err := env.JS.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
}

// A gap: an order's second event never reaches the stream (a relay that
// skipped it). The third waits subscribers.gap_wait for it, then is
// applied marked AfterGap, which fulfilment records as a violation; the
// second, arriving after all, is refused as late.
func TestGapIsWaitedForThenMarked(t *testing.T) {
	t.Parallel()
	env, _ := newEnv(t)
	env.Config.Subscribers.GapWait = 3 * time.Second
	env.StartRunner(fulfilment.Subscriber, nil)
	ctx := context.Background()
	const order = 424242
	publish := func(id, seq int64, eventType string, payload string) {
		publishOrderEvent(t, env, order, id, seq, eventType, payload)
	}
	publish(9000001, 1, shop.OrderCreated, `{"order_id": 424242, "customer": "gap", "lines": 1}`)
	start := time.Now()
	publish(9000003, 3, shop.OrderShipped, `{"order_id": 424242, "from": "paid", "to": "shipped", "n": 3}`)
	var reason string
	subscribertest.WaitFor(t, 30*time.Second, "the third event applied after the gap", func() (bool, string) {
		err := env.DB.Pool.QueryRow(ctx, `SELECT reason FROM fulfilment_violations WHERE event_id = 9000003`).Scan(&reason)
		return err == nil, fmt.Sprint(err)
	})
	if waited := time.Since(start); waited < 3*time.Second || !strings.Contains(reason, "after a gap") {
		t.Errorf("violation %q after %s; want after a gap, after gap_wait (3s)", reason, waited)
	}
	publish(9000002, 2, shop.OrderPaid, `{"order_id": 424242, "from": "created", "to": "paid", "n": 2}`)
	subscribertest.WaitFor(t, 30*time.Second, "the late second event in the dead letters", func() (bool, string) {
		for _, m := range env.DeadLetters(fulfilment.Name) {
			if m.Header.Get(wire.EventIDHeader) == "9000002" {
				return strings.Contains(m.Header.Get(subscribers.DeadReasonHeader), "moved past it"), m.Header.Get(subscribers.DeadReasonHeader)
			}
		}
		return false, "none yet"
	})
	var applied int
	if err := env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM fulfilment_history WHERE order_id = $1`, order).Scan(&applied); err != nil || applied != 1 {
		t.Errorf("%d transitions applied (%v), want 1 (the creation)", applied, err)
	}
}

// A consumer that began after the stream's start (subscribers.start new)
// sees an order's later events without its earlier ones: the first one
// seen is applied at once, marked AfterGap (fulfilment records it), not
// taken for the order's first event, and not held for gap_wait either
// (the wait for all three is shorter than gap_wait); the next one follows,
// unmarked. An order created since starts at its first event, unmarked.
func TestFirstEventSeenAfterAStartNewIsMarked(t *testing.T) {
	t.Parallel()
	env, _ := newEnv(t)
	env.Config.Subscribers.GapWait = 10 * time.Minute
	env.StartRunner(fulfilment.Subscriber, func(o *subscribers.Options) { o.Config.Start = "new" })
	ctx := context.Background()
	publishOrderEvent(t, env, 515151, 8000003, 3, shop.OrderShipped, `{"order_id": 515151, "from": "paid", "to": "shipped", "n": 3}`)
	publishOrderEvent(t, env, 515151, 8000004, 4, shop.OrderDelivered, `{"order_id": 515151, "from": "shipped", "to": "delivered", "n": 4}`)
	publishOrderEvent(t, env, 616161, 8000011, 1, shop.OrderCreated, `{"order_id": 616161, "customer": "new", "lines": 1}`)
	subscribertest.WaitFor(t, time.Minute, "all three events checkpointed", func() (bool, string) {
		done, err := bookkeeping.New(env.DB.Pool).CheckpointList(ctx, bookkeeping.CheckpointParams{Subscriber: fulfilment.Name, EventIDs: []int64{8000003, 8000004, 8000011}})
		return err == nil && len(done) == 3, fmt.Sprintf("%v (%v)", done, err)
	})
	type violation struct {
		EventID int64
		Reason  string
	}
	rows, _ := env.DB.Pool.Query(ctx, `SELECT event_id, reason FROM fulfilment_violations WHERE order_id IN (515151, 616161)`)
	found, err := pgx.CollectRows(rows, pgx.RowToStructByPos[violation])
	if err != nil {
		t.Fatal(err)
	}
	violations := map[int64]string{}
	for _, v := range found {
		violations[v.EventID] = v.Reason
	}
	// Fulfilment applies no transition after a gap, so the next one is out
	// of order to it: recorded, but not marked AfterGap.
	if !strings.Contains(violations[8000003], "after a gap") || strings.Contains(violations[8000004], "after a gap") {
		t.Errorf("violations %v; want the first event seen of order 515151 marked after a gap, and only it", violations)
	}
	if r, ok := violations[8000011]; ok {
		t.Errorf("the first event of an order created since the start: %s", r)
	}
}
