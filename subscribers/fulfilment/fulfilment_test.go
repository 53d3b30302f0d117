package fulfilment_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
	"golang.org/x/sync/errgroup"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newEnv is a pipeline with one product to order.
func newEnv(t *testing.T) (*subscribertest.Env, int64) {
	t.Helper()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.Concurrency = 4
	env.Config.Subscribers.GapWait = time.Minute
	if _, err := shop.Seed(context.Background(), env.DB.Pool, 1, rand.New(rand.NewPCG(3, 3))); err != nil {
		t.Fatal(err)
	}
	var product int64
	if err := env.DB.Pool.QueryRow(context.Background(), `SELECT min(id) FROM products`).Scan(&product); err != nil {
		t.Fatal(err)
	}
	return env, product
}

// jittery is the fulfilment handler taking a little while on each event,
// as a real one talking to a warehouse would: events handled side by side
// then finish in any order.
type jittery struct{ fulfilment.Handler }

func (j jittery) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	time.Sleep(time.Duration(rand.N(3000)) * time.Microsecond)
	return j.Handler.HandleTx(ctx, tx, ev)
}

// flaky is jittery, and fails its first attempt on every order.paid event,
// as a warehouse that timed out would: the event is retried after a
// backoff, and its order's later events must wait for it.
type flaky struct {
	jittery
	failed *sync.Map
}

func newFlaky() flaky { return flaky{failed: &sync.Map{}} }

func (f flaky) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	if _, again := f.failed.LoadOrStore(ev.ID, true); ev.Type == shop.OrderPaid && !again {
		return errors.New("the warehouse timed out")
	}
	return f.jittery.HandleTx(ctx, tx, ev)
}

var moves = []func(context.Context, pgx.Tx, int64) (int64, error){shop.PayOrder, shop.ShipOrder, shop.DeliverOrder}

// rushOrders has writers each create orders and take every one straight
// through its life (paid, shipped, then delivered, or cancelled at a random
// step), one transaction per step: an order's events are next to each
// other in the stream.
func rushOrders(t *testing.T, env *subscribertest.Env, product int64, writers, perWriter int, seed uint64) {
	t.Helper()
	ctx := context.Background()
	var g errgroup.Group
	for w := range writers {
		g.Go(func() error {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for range perWriter {
				var order int64
				err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) (err error) {
					order, _, err = shop.CreateOrder(ctx, tx, "w"+strconv.Itoa(w), []shop.OrderLine{{ProductID: product, Quantity: 1}})
					return err
				})
				steps := 3
				if rng.IntN(4) == 0 {
					steps = rng.IntN(3) // cancelled after this many steps
				}
				for i := 0; err == nil && i < steps; i++ {
					err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { _, err := moves[i](ctx, tx, order); return err })
				}
				if err == nil && steps < 3 {
					err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { _, err := shop.CancelOrder(ctx, tx, order); return err })
				}
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
}

// mixOrders has writers race over a shared set of open orders: each step
// takes a random open order to its next status (or cancels it), so two
// writers may move one order at once (one of them waits on its lock, and
// may then find the move no longer allowed).
func mixOrders(t *testing.T, env *subscribertest.Env, product int64, writers, orders int, seed uint64) {
	t.Helper()
	ctx := context.Background()
	var mu sync.Mutex
	open := map[int64]int{} // order → steps taken
	created := 0
	var g errgroup.Group
	for w := range writers {
		g.Go(func() error {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for {
				mu.Lock()
				if created == orders && len(open) == 0 {
					mu.Unlock()
					return nil
				}
				var order int64
				step := -1
				if created < orders && (len(open) < 8 || rng.IntN(3) == 0) {
					created++
				} else if len(open) > 0 {
					n := rng.IntN(len(open))
					for id, s := range open {
						if n == 0 {
							order, step = id, s
							break
						}
						n--
					}
				} else {
					mu.Unlock()
					time.Sleep(time.Millisecond)
					continue
				}
				mu.Unlock()
				var err error
				ended := false
				switch {
				case step < 0:
					err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) (err error) {
						order, _, err = shop.CreateOrder(ctx, tx, "mix", []shop.OrderLine{{ProductID: product, Quantity: 1}})
						return err
					})
					step = 0
				case rng.IntN(6) == 0:
					err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { _, err := shop.CancelOrder(ctx, tx, order); return err })
					ended = true
				default:
					err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { _, err := moves[step](ctx, tx, order); return err })
					step++
					ended = step == 3
				}
				if errors.Is(err, shop.ErrTransition) {
					continue // another writer moved it first
				}
				if err != nil {
					return err
				}
				mu.Lock()
				if ended {
					delete(open, order)
				} else if _, present := open[order]; present || step == 0 {
					open[order] = step
				}
				mu.Unlock()
			}
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
}

// waitFollowed waits until fulfilment has applied every committed
// transition (or recorded a violation), but for held ones, then returns
// what differs.
func waitFollowed(t *testing.T, env *subscribertest.Env, timeout time.Duration, held ...int) []string {
	t.Helper()
	ctx := context.Background()
	var committed int
	if err := env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM order_transitions`).Scan(&committed); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, timeout, "fulfilment to take every transition", func() (bool, string) {
		var applied, violations int
		if err := env.DB.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM fulfilment_history), (SELECT count(*) FROM fulfilment_violations)`).
			Scan(&applied, &violations); err != nil {
			return false, err.Error()
		}
		return applied+violations+sum(held) >= committed, fmt.Sprintf("%d committed, %d applied, %d violations", committed, applied, violations)
	})
	env.WaitIdle(fulfilment.Name, 30*time.Second)
	diffs, err := fulfilment.Compare(ctx, env.DB.Pool, 20)
	if err != nil {
		t.Fatal(err)
	}
	return diffs
}

func sum(ns []int) (s int) {
	for _, n := range ns {
		s += n
	}
	return s
}

// failOnce fails the first publish of one event in three.
func failOnce() func(int64) bool {
	var failed sync.Map
	return func(id int64) bool {
		if id%3 != 0 {
			return false
		}
		_, seen := failed.LoadOrStore(id, true)
		return !seen
	}
}

// Two relays, one failing the first publish of every third event, and
// three instances of the ordered subscriber: every order's applied history
// is its committed history, and no violation is recorded.
func TestOrdersFollowTheirHistory(t *testing.T) {
	t.Parallel()
	env, product := newEnv(t)
	env.StartRelay(testhooks.Relay{FailPublish: failOnce()})
	h := newFlaky()
	for range 3 {
		env.StartRunner(subscribertest.HandledBy(fulfilment.Subscriber, subscribers.Tx(h)), nil)
	}
	rushOrders(t, env, product, 4, 15, 1)
	mixOrders(t, env, product, 4, 40, 2)
	if diffs := waitFollowed(t, env, time.Minute); len(diffs) > 0 {
		t.Errorf("fulfilment differs from the orders' history:\n%s", strings.Join(diffs, "\n"))
	}
	var applied int
	if err := env.DB.Pool.QueryRow(context.Background(), `SELECT count(*) FROM fulfilment_history`).Scan(&applied); err != nil || applied < 200 {
		t.Errorf("%d transitions applied (%v), want at least 200", applied, err)
	}
}

// The proof that the test above can fail: the same handler, run unordered
// (declared without Ordered) over the orders' events, handles an order's events side
// by side, and its later events overtake a paid event being retried: it
// records violations.
func TestUnorderedHandlingBreaksHistories(t *testing.T) {
	t.Parallel()
	env, product := newEnv(t)
	env.Config.Subscribers.BatchSize = 1
	rushOrders(t, env, product, 4, 15, 1)
	subscribertest.WaitFor(t, time.Minute, "every event published", func() (bool, string) {
		var unsent int
		err := env.DB.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE status <> 'sent'`).Scan(&unsent)
		return err == nil && unsent == 0, fmt.Sprintf("%d unsent (%v)", unsent, err)
	})
	h := newFlaky()
	unordered := fulfilment.Subscriber
	unordered.Ordered = false
	for range 2 {
		env.StartRunner(subscribertest.HandledBy(unordered, subscribers.Tx(h)), nil)
	}
	diffs := waitFollowed(t, env, time.Minute)
	if len(diffs) == 0 {
		t.Fatal("the unordered runtime applied every order's history in order: the ordered tests prove nothing")
	}
	t.Logf("as expected, %d differences, the first: %s", len(diffs), diffs[0])
}

// An instance killed after committing an order's event and before acking
// it: the standby takes over (after pinned_ttl), the redelivered event is
// a duplicate, and every order's history is whole and in order.
func TestOrdersSurviveAnInstanceKilledMidAggregate(t *testing.T) {
	t.Parallel()
	env, product := newEnv(t)
	var killed atomic.Bool
	kill := make(chan struct{})
	first := env.Connect()
	a := env.NewRunner(subscribertest.HandledBy(fulfilment.Subscriber, subscribers.Tx(jittery{})), func(o *subscribers.Options) { o.Conn = first })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.Start(testhooks.WithSubscriber(ctx, testhooks.Subscriber{BeforeAck: func(ctx context.Context, ids []int64) {
		if len(ids) > 0 && ids[0]%7 == 0 && killed.CompareAndSwap(false, true) {
			close(kill) // dies here: committed, not acked
			<-ctx.Done()
		}
	}})); err != nil {
		t.Fatal(err)
	}
	env.StartRunner(subscribertest.HandledBy(fulfilment.Subscriber, subscribers.Tx(jittery{})), nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		rushOrders(t, env, product, 3, 15, 3)
	}()
	select {
	case <-kill:
	case <-time.After(time.Minute):
		t.Fatal("the first instance never handled an event to be killed on")
	}
	first.Close()
	dead, cancelDead := context.WithCancel(context.Background())
	cancelDead()
	_ = a.Stop(dead)
	<-done
	if diffs := waitFollowed(t, env, 2*time.Minute); len(diffs) > 0 {
		t.Errorf("fulfilment differs from the orders' history:\n%s", strings.Join(diffs, "\n"))
	}
}

// Instances start and stop under load; the pin moves from one to the next.
func TestOrdersSurviveInstancesAddedAndRemoved(t *testing.T) {
	t.Parallel()
	env, product := newEnv(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		mixOrders(t, env, product, 4, 80, 4)
	}()
	var running []*subscribers.Runner
	for i := 0; ; i++ {
		running = append(running, env.StartRunner(subscribertest.HandledBy(fulfilment.Subscriber, subscribers.Tx(jittery{})), nil))
		if i%2 == 1 {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if err := running[0].Stop(ctx); err != nil {
				t.Error(err)
			}
			cancel()
			running = running[1:]
		}
		select {
		case <-done:
		case <-time.After(700 * time.Millisecond):
			continue
		}
		break
	}
	if diffs := waitFollowed(t, env, 2*time.Minute); len(diffs) > 0 {
		t.Errorf("fulfilment differs from the orders' history:\n%s", strings.Join(diffs, "\n"))
	}
}

// poisonedOrder writes an order's life with a malformed order.shipped in
// the middle (after paid, before the real shipped and delivered), and
// returns the order and the poison's event id.
func poisonedOrder(t *testing.T, env *subscribertest.Env, product int64) (order, poison int64) {
	t.Helper()
	ctx := context.Background()
	step := func(fn func(tx pgx.Tx) error) {
		if err := pgx.BeginFunc(ctx, env.DB.Pool, fn); err != nil {
			t.Fatal(err)
		}
	}
	step(func(tx pgx.Tx) (err error) {
		order, _, err = shop.CreateOrder(ctx, tx, "poisoned", []shop.OrderLine{{ProductID: product, Quantity: 1}})
		return err
	})
	step(func(tx pgx.Tx) error { _, err := shop.PayOrder(ctx, tx, order); return err })
	step(func(tx pgx.Tx) (err error) {
		poison, err = outbox.Write(ctx, tx, outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: strconv.FormatInt(order, 10),
			Type: shop.OrderShipped, Payload: []byte(`{"order_id": "not a number"}`)})
		return err
	})
	step(func(tx pgx.Tx) error { _, err := shop.ShipOrder(ctx, tx, order); return err })
	step(func(tx pgx.Tx) error { _, err := shop.DeliverOrder(ctx, tx, order); return err })
	return order, poison
}

// A poison event in the middle of an order's history goes to the dead
// letters and holds that order's later events (dead-lettered behind it,
// naming it), and only that order's. Discarding the poison releases the
// order; redriving the held letters, in order, completes its history.
func TestPoisonEventHoldsOnlyItsOrder(t *testing.T) {
	t.Parallel()
	env, product := newEnv(t)
	r := env.StartRunner(fulfilment.Subscriber, nil)
	order, poison := poisonedOrder(t, env, product)
	rushOrders(t, env, product, 2, 10, 5)
	subscribertest.WaitFor(t, time.Minute, "3 dead letters", func() (bool, string) {
		n := len(env.DeadLetters(fulfilment.Name))
		return n >= 3, fmt.Sprintf("%d dead letters", n)
	})
	diffs := waitFollowed(t, env, time.Minute, 2)
	want := []string{
		fmt.Sprintf("order %d transition 3: committed paid>shipped, applied nothing", order),
		fmt.Sprintf("order %d transition 4: committed shipped>delivered, applied nothing", order),
	}
	if strings.Join(diffs, "\n") != strings.Join(want, "\n") {
		t.Fatalf("while held, differences:\n%s\nwant only the poisoned order's last two:\n%s", strings.Join(diffs, "\n"), strings.Join(want, "\n"))
	}
	letters := env.DeadLetters(fulfilment.Name)
	if len(letters) != 3 {
		t.Fatalf("%d dead letters, want 3", len(letters))
	}
	var held []subscribers.Event
	for i, m := range letters {
		ev, err := subscribers.EventFromParts(m.Data, m.Header, m.Header.Get(subscribers.DeadSubjectHeader), env.Config.Stream.SubjectPrefix)
		if i == 0 {
			if ev.ID != poison || !strings.Contains(m.Header.Get(subscribers.DeadReasonHeader), "malformed") || m.Header.Get(subscribers.DeadHeldByHeader) != "" {
				t.Errorf("first dead letter: event %d (%v), reason %q, held by %q; want the poison %d, malformed, held by none",
					ev.ID, err, m.Header.Get(subscribers.DeadReasonHeader), m.Header.Get(subscribers.DeadHeldByHeader), poison)
			}
			continue
		}
		if err != nil || m.Header.Get(subscribers.DeadHeldByHeader) != strconv.FormatInt(poison, 10) ||
			!strings.Contains(m.Header.Get(subscribers.DeadReasonHeader), "held behind event "+strconv.FormatInt(poison, 10)) {
			t.Errorf("dead letter %d: event %d (%v), held by %q, reason %q; want held behind %d", i, ev.ID, err,
				m.Header.Get(subscribers.DeadHeldByHeader), m.Header.Get(subscribers.DeadReasonHeader), poison)
		}
		held = append(held, ev)
	}
	counts, err := subscribers.CountHeldAggregates(context.Background(), env.DB.Pool)
	if err != nil || counts[fulfilment.Name] != 1 {
		t.Errorf("held aggregates %v (%v), want 1 for %s", counts, err, fulfilment.Name)
	}

	// Redriving a held event before its holder is released is refused.
	ctx := context.Background()
	if _, err := r.HandleOnce(ctx, held[0]); err == nil || !strings.Contains(err.Error(), "held behind") {
		t.Errorf("redrive of a held event before the poison is released: %v, want held behind", err)
	}
	if ok, err := bookkeeping.New(env.DB.Pool).AggregateRelease(ctx, bookkeeping.CheckpointKeyParams{Subscriber: fulfilment.Name, EventID: poison}); err != nil || !ok {
		t.Fatalf("release the order held behind the poison: %t, %v", ok, err)
	}
	for _, ev := range held {
		if handled, err := r.HandleOnce(ctx, ev); err != nil || !handled {
			t.Fatalf("redrive event %d: handled %t, %v", ev.ID, handled, err)
		}
	}
	if diffs, err := fulfilment.Compare(ctx, env.DB.Pool, 20); err != nil || len(diffs) > 0 {
		t.Errorf("after the release and the redrives, differences (%v):\n%s", err, strings.Join(diffs, "\n"))
	}
	// The order's later events flow again.
	if err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Write(ctx, tx, outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: strconv.FormatInt(order, 10),
			Type: shop.OrderCancelled, Payload: shop.OrderTransition{OrderID: order, From: shop.StatusDelivered, To: shop.StatusCancelled, N: 5}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, 30*time.Second, "the order's next event handled, as a violation (nothing follows delivered)", func() (bool, string) {
		var n int
		_ = env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM fulfilment_violations WHERE order_id = $1 AND reason LIKE '%after the order ended%'`, order).Scan(&n)
		return n == 1, fmt.Sprintf("%d violations", n)
	})
}

// Under subscribers.on_dead_letter=skip the poison's order goes on without
// it: its later events are applied, nothing is held.
func TestPoisonEventSkippedByPolicy(t *testing.T) {
	t.Parallel()
	env, product := newEnv(t)
	env.Config.Subscribers.OnDeadLetter = "skip"
	env.StartRunner(fulfilment.Subscriber, nil)
	poisonedOrder(t, env, product)
	rushOrders(t, env, product, 2, 5, 6)
	if diffs := waitFollowed(t, env, time.Minute); len(diffs) > 0 {
		t.Errorf("fulfilment differs from the orders' history:\n%s", strings.Join(diffs, "\n"))
	}
	if n := len(env.DeadLetters(fulfilment.Name)); n != 1 {
		t.Errorf("%d dead letters, want 1 (the poison)", n)
	}
}

func TestConformance(t *testing.T) {
	subscribertest.Run(t, subscribertest.Case{
		Subscriber: fulfilment.Subscriber,
		Valid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, error) {
			// An order of its own (fulfilment reads no shop table): its
			// creation event, the first of its aggregate.
			id := time.Now().UnixNano()
			return outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: strconv.FormatInt(id, 10), Type: shop.OrderCreated,
				Payload: shop.OrderEvent{OrderID: id, Customer: "test", Lines: 1}}, nil
		},
		// The transition this very event applied: its history row names it.
		Effects: func(env *subscribertest.Env, ev outbox.Event, id int64) int {
			var n int
			err := env.DB.Pool.QueryRow(context.Background(), `SELECT count(*) FROM fulfilment_history WHERE order_id = $1::bigint AND event_id = $2`,
				ev.AggregateID, id).Scan(&n)
			if err != nil {
				env.T.Fatal(err)
			}
			return n
		},
		Invalid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, string, error) {
			return outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: "x", Type: shop.OrderPaid,
				Payload: []byte(`{"order_id": 1}`)}, "malformed order event", nil
		},
		// Not CheckpointOnly: with its processed_events row deleted, the
		// event is still behind its aggregate's checkpoint, and a
		// redelivery is refused as late rather than applied again.
	})
}
