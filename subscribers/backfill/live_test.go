package backfill_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/fanout/fanout/subscribers/orderstatus"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// shopWithOrders seeds a catalog and n orders, some of them moved on, all
// published; then the stream drops every event, as its max age does.
func shopWithOrders(t *testing.T, env *subscribertest.Env, n int) (products []int64) {
	t.Helper()
	ctx := context.Background()
	if _, err := shop.Seed(ctx, env.DB.Pool, 3, rand.New(rand.NewPCG(3, 4))); err != nil {
		t.Fatal(err)
	}
	rows, _ := env.DB.Pool.Query(ctx, `SELECT id FROM products`)
	products, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(products) == 0 {
		t.Fatalf("products: %v %v", products, err)
	}
	if err := orderstatus.CreateTable(ctx, env.DB.Pool); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
			id, _, err := shop.CreateOrder(ctx, tx, "c", []shop.OrderLine{{ProductID: products[i%len(products)], Quantity: 1}})
			if err == nil && i%3 == 0 {
				_, err = shop.PayOrder(ctx, tx, id)
			}
			return nil, err
		})
	}
	var sent []int64
	if err := env.DB.Pool.QueryRow(ctx, `SELECT array_agg(id) FROM outbox`).Scan(&sent); err != nil {
		t.Fatal(err)
	}
	env.WaitSent(sent...)
	env.ExpireStream()
	return products
}

// moveOrders advances or creates orders, with their events, until stop,
// counting its commits in moves.
func moveOrders(ctx context.Context, t *testing.T, env *subscribertest.Env, products []int64, stop *atomic.Bool, moves *atomic.Int64) {
	r := rand.New(rand.NewPCG(5, 6))
	for !stop.Load() {
		tx, err := env.DB.Pool.Begin(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		var id int64
		_ = tx.QueryRow(ctx, `SELECT id FROM orders WHERE status NOT IN ('delivered', 'cancelled') ORDER BY random() LIMIT 1`).Scan(&id)
		switch op := r.IntN(10); {
		case id == 0 || op == 0:
			_, _, err = shop.CreateOrder(ctx, tx, "live", []shop.OrderLine{{ProductID: products[r.IntN(len(products))], Quantity: 2}})
		case op == 1:
			_, err = shop.CancelOrder(ctx, tx, id)
		default:
			var status string
			_ = tx.QueryRow(ctx, `SELECT status FROM orders WHERE id = $1`, id).Scan(&status)
			next := map[string]func(context.Context, pgx.Tx, int64) (int64, error){
				shop.StatusCreated: shop.PayOrder, shop.StatusPaid: shop.ShipOrder, shop.StatusShipped: shop.DeliverOrder}[status]
			if next != nil {
				_, err = next(ctx, tx, id)
			}
		}
		if err == nil {
			err = tx.Commit(ctx)
			moves.Add(1)
		}
		_ = tx.Rollback(ctx)
		if err != nil && !errors.Is(err, shop.ErrTransition) {
			t.Error(err)
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// orderStatusErrors compares the copy with Postgres: every order, at its
// current status and version.
func orderStatusErrors(ctx context.Context, pool *pgxpool.Pool) error {
	diffs, err := orderstatus.Compare(ctx, pool, 5)
	if err != nil {
		return err
	}
	if len(diffs) > 0 {
		return errors.New(strings.Join(diffs, "; "))
	}
	return nil
}

// A subscriber added to a shop whose stream has already dropped every
// event of its 600 orders: its backfill runs while writers create orders
// and move them on (with their events, which the subscriber gets live).
// It ends with every order at its latest status, none older.
func TestANewSubscriberStartsFromTheTruth(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	products := shopWithOrders(t, env, 600)
	ctx := context.Background()
	env.StartRunner(orderstatus.Subscriber, nil)

	var stop atomic.Bool
	var moves, backfilled atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() { moveOrders(ctx, t, env, products, &stop, &moves) })
	// The live writers keep pace with the backfill, whatever the machine's
	// load: a live write for every 4 rows backfilled, at least.
	paced := &orderstatus.Handler{BeforeWrite: func(ev subscribers.Event, _ int64) {
		n := backfilled.Add(1)
		for moves.Load() < n/4 && !stop.Load() && !t.Failed() {
			time.Sleep(time.Millisecond)
		}
	}}
	s, err := backfill.Run(ctx, backfill.Options{Declaration: orderstatus.Subscriber, Handler: subscribers.Tx(paced),
		Config: env.Config.Subscribers, Pool: env.DB.Pool, Logger: env.Logger, Chunk: 20, Rate: 400})
	stop.Store(true)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if !s.Finished() || s.Done < 600 || s.Failed != 0 {
		t.Fatalf("backfill %+v, want finished with at least the 600 orders, none failed", s)
	}
	env.WaitAllSent()
	env.WaitIdle(orderstatus.Name, 30*time.Second)
	if err := orderStatusErrors(ctx, env.DB.Pool); err != nil {
		t.Fatalf("after a backfill beside %d live writes: %v", moves.Load(), err)
	}
	if moves.Load() < 100 {
		t.Fatalf("only %d live writes during the backfill", moves.Load())
	}
	t.Logf("backfill of %d orders beside %d live writes", s.Done, moves.Load())
}

// The order in which a backfill event and a live event of one order apply
// cannot regress the copy: the backfill reads order 1 as created, the
// order is paid and the live event applied, then the backfill writes what
// it read. The guarded write keeps the newer state; the unguarded one (the
// flaw the check must see) regresses it, and orderStatusErrors says so.
func TestBackfillAndALiveEventApplyInEitherOrder(t *testing.T) {
	for _, unguarded := range []bool{false, true} {
		t.Run(fmt.Sprintf("unguarded=%t", unguarded), func(t *testing.T) {
			t.Parallel()
			env := subscribertest.NewEnv(t)
			shopWithOrders(t, env, 3)
			ctx := context.Background()
			var first int64
			if err := env.DB.Pool.QueryRow(ctx, `SELECT min(id) FROM orders WHERE status = 'created'`).Scan(&first); err != nil {
				t.Fatal(err)
			}
			live := &orderstatus.Handler{Unguarded: unguarded}
			env.StartRunner(subscribertest.HandledBy(orderstatus.Subscriber, subscribers.Tx(live)), nil)
			var once sync.Once
			backfilled := &orderstatus.Handler{Unguarded: unguarded, BeforeWrite: func(ev subscribers.Event, orderID int64) {
				if orderID != first || ev.Headers.Get(subscribers.BackfillHeader) == "" {
					return
				}
				once.Do(func() {
					env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
						_, err := shop.PayOrder(ctx, tx, first)
						return nil, err
					})
					subscribertest.WaitFor(t, 10*time.Second, "the live event applied", func() (bool, string) {
						var v int
						_ = env.DB.Pool.QueryRow(ctx, `SELECT version FROM order_status_copy WHERE order_id = $1`, first).Scan(&v)
						return v == 2, fmt.Sprint("version ", v)
					})
				})
			}}
			s, err := backfill.Run(ctx, backfill.Options{Declaration: orderstatus.Subscriber,
				Handler: subscribers.Tx(backfilled), Config: env.Config.Subscribers, Pool: env.DB.Pool, Logger: env.Logger})
			if err != nil || !s.Finished() {
				t.Fatalf("backfill %+v: %v", s, err)
			}
			env.WaitAllSent()
			env.WaitIdle(orderstatus.Name, 30*time.Second)
			err = orderStatusErrors(ctx, env.DB.Pool)
			switch want := fmt.Sprintf("order %d is paid (version 2), its copy created (version 1)", first); {
			case !unguarded && err != nil:
				t.Fatalf("the guarded copy: %v", err)
			case unguarded && (err == nil || err.Error() != want):
				t.Fatalf("the unguarded copy: the check found %v, want %q", err, want)
			}
		})
	}
}
