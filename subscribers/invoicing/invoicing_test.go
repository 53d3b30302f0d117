package invoicing_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// insertOrder writes an order with two lines for existing products, without
// its event (the caller decides what event to write).
func insertOrder(ctx context.Context, tx pgx.Tx) (int64, error) {
	var productID int64
	if err := tx.QueryRow(ctx, `SELECT id FROM products ORDER BY id LIMIT 1`).Scan(&productID); err != nil {
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, err
		}
		p, err := shop.RandomProduct(ctx, tx, rand.New(rand.NewPCG(1, 2)))
		if err != nil {
			// No brands yet: seed them in this transaction.
			return 0, err
		}
		if productID, err = shop.CreateProduct(ctx, tx, p); err != nil {
			return 0, err
		}
	}
	var orderID int64
	if err := tx.QueryRow(ctx, `INSERT INTO orders (customer) VALUES ('test') RETURNING id`).Scan(&orderID); err != nil {
		return 0, err
	}
	_, err := tx.Exec(ctx, `
INSERT INTO order_lines (order_id, line_no, product_id, quantity, unit_price)
VALUES ($1, 1, $2, 2, 10.50), ($1, 2, $2, 1, 3.25)`, orderID, productID)
	return orderID, err
}

func seedCatalog(t *testing.T, env *subscribertest.Env) {
	t.Helper()
	if _, err := shop.Seed(context.Background(), env.DB.Pool, 3, rand.New(rand.NewPCG(7, 7))); err != nil {
		t.Fatal(err)
	}
}

func orderEvent(orderID int64) outbox.Event {
	return outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: strconv.FormatInt(orderID, 10), Type: shop.OrderCreated,
		Payload: shop.OrderEvent{OrderID: orderID, Customer: "test", Lines: 2}}
}

func invoicesOf(env *subscribertest.Env, orderID int64) int {
	var n int
	if err := env.DB.Pool.QueryRow(context.Background(), `SELECT count(*) FROM invoices WHERE order_id = $1`, orderID).Scan(&n); err != nil {
		env.T.Fatal(err)
	}
	return n
}

var conformance = subscribertest.Case{
	Subscriber: invoicing.Subscriber,
	Handler: func(env *subscribertest.Env) subscribers.Handler {
		seedCatalog(env.T, env)
		return subscribers.Tx(invoicing.New())
	},
	Valid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, error) {
		id, err := insertOrder(context.Background(), tx)
		return orderEvent(id), err
	},
	Effects: func(env *subscribertest.Env, ev outbox.Event, _ int64) int {
		return invoicesOf(env, ev.Payload.(shop.OrderEvent).OrderID)
	},
	Invalid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, string, error) {
		return outbox.Event{AggregateType: "order", AggregateID: "x", Type: shop.OrderCreated,
			Payload: []byte(`{"order_id": "not a number"}`)}, "malformed order.created payload", nil
	},
}

func TestConformance(t *testing.T) { subscribertest.Run(t, conformance) }

func TestInvoiceContents(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	seedCatalog(t, env)
	env.StartRunner(invoicing.Subscriber, nil)
	var orderID int64
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		var err error
		orderID, err = insertOrder(context.Background(), tx)
		return []outbox.Event{orderEvent(orderID)}, err
	})
	subscribertest.WaitFor(t, 10*time.Second, "the invoice", func() (bool, string) { return invoicesOf(env, orderID) == 1, "" })
	var number string
	var total float64
	var lines int
	var lineSum float64
	err := env.DB.Pool.QueryRow(context.Background(), `
SELECT i.number, i.total::float8, count(l.*), sum(l.amount)::float8
FROM invoices i JOIN invoice_lines l ON l.invoice_id = i.id
WHERE i.order_id = $1 GROUP BY i.id`, orderID).Scan(&number, &total, &lines, &lineSum)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(number, "INV-") || total != 24.25 || lines != 2 || lineSum != total {
		t.Errorf("invoice %s total %.2f with %d lines summing %.2f; want INV-..., 24.25, 2 lines", number, total, lines, lineSum)
	}
}

// Two instances racing on a stream with duplicates: one invoice per order.
func TestExactlyOneInvoicePerOrderWithTwoInstancesAndDuplicates(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	seedCatalog(t, env)
	env.StartRunner(invoicing.Subscriber, nil)
	env.StartRunner(invoicing.Subscriber, nil)
	const orders = 200
	var ids []int64
	for range orders / 20 {
		ids = append(ids, env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
			var evs []outbox.Event
			for range 20 {
				id, err := insertOrder(context.Background(), tx)
				if err != nil {
					return nil, err
				}
				evs = append(evs, orderEvent(id))
			}
			return evs, nil
		})...)
	}
	env.WaitSent(ids...)
	for _, id := range ids[:30] {
		env.Republish(id)
	}
	env.WaitIdle(invoicing.Name, 30*time.Second)
	var invoiced, invoices, multi int
	err := env.DB.Pool.QueryRow(context.Background(), `
SELECT count(DISTINCT o.id), count(i.id), count(*) FILTER (WHERE i.order_id IN (SELECT order_id FROM invoices GROUP BY order_id HAVING count(*) > 1))
FROM orders o LEFT JOIN invoices i ON i.order_id = o.id`).Scan(&invoiced, &invoices, &multi)
	if err != nil {
		t.Fatal(err)
	}
	if invoiced != orders || invoices != orders || multi != 0 {
		t.Errorf("%d orders, %d invoices, %d orders invoiced twice; want %d, %d, 0", invoiced, invoices, multi, orders, orders)
	}
}

// flaky fails its first n calls for each event with a plain error.
type flaky struct {
	invoicing.Handler
	mu    sync.Mutex
	fails map[int64]int
	n     int
}

func (f *flaky) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	f.mu.Lock()
	failed := f.fails[ev.ID]
	if failed < f.n {
		f.fails[ev.ID]++
	}
	f.mu.Unlock()
	if failed < f.n {
		return errors.New("database hiccup")
	}
	return f.Handler.HandleTx(ctx, tx, ev)
}

func TestFailsThreeTimesThenSucceedsMakesOneInvoice(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	seedCatalog(t, env)
	fl := &flaky{fails: map[int64]int{}, n: 3}
	env.StartRunner(subscribertest.HandledBy(invoicing.Subscriber, subscribers.Tx(fl)), nil)
	var orderID int64
	id := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		var err error
		orderID, err = insertOrder(context.Background(), tx)
		return []outbox.Event{orderEvent(orderID)}, err
	})[0]
	subscribertest.WaitFor(t, 20*time.Second, "the invoice", func() (bool, string) { return invoicesOf(env, orderID) == 1, "" })
	env.WaitIdle(invoicing.Name, 10*time.Second)
	if n := invoicesOf(env, orderID); n != 1 {
		t.Errorf("%d invoices, want 1", n)
	}
	fl.mu.Lock()
	defer fl.mu.Unlock()
	if fl.fails[id] != 3 {
		t.Errorf("handler failed %d times, want 3", fl.fails[id])
	}
	if len(env.DeadLetters(invoicing.Name)) != 0 {
		t.Error("a retried event reached the dead letters")
	}
}

func TestBadOrdersGoToDeadLettersAndOthersFlow(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	seedCatalog(t, env)
	env.StartRunner(invoicing.Subscriber, nil)
	var good int64
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		ctx := context.Background()
		missing, err := insertOrder(ctx, tx)
		if err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `UPDATE order_lines SET product_id = 987654 WHERE order_id = $1 AND line_no = 2`, missing); err != nil {
			return nil, err
		}
		if good, err = insertOrder(ctx, tx); err != nil {
			return nil, err
		}
		return []outbox.Event{orderEvent(987653), orderEvent(missing), orderEvent(good)}, nil
	})
	subscribertest.WaitFor(t, 15*time.Second, "the good order's invoice", func() (bool, string) { return invoicesOf(env, good) == 1, "" })
	env.WaitIdle(invoicing.Name, 15*time.Second)
	reasons := map[string]bool{}
	for _, d := range env.DeadLetters(invoicing.Name) {
		reasons[d.Header.Get(subscribers.DeadReasonHeader)] = true
	}
	for _, want := range []string{"unknown order: order 987653 does not exist", "line 2 names product 987654, which does not exist"} {
		found := false
		for r := range reasons {
			found = found || strings.Contains(r, want)
		}
		if !found {
			t.Errorf("no dead letter saying %q; have %v", want, reasons)
		}
	}
}

// An order line keeps what was sold: a product deleted after the order was
// placed does not keep its order from being invoiced.
func TestProductDeletedAfterTheOrderIsStillInvoiced(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	seedCatalog(t, env)
	ctx := context.Background()
	var orderID, productID int64
	var sku string
	env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		if err := tx.QueryRow(ctx, `SELECT id, sku FROM products ORDER BY id LIMIT 1`).Scan(&productID, &sku); err != nil {
			return nil, err
		}
		var err error
		orderID, _, err = shop.CreateOrder(ctx, tx, "late", []shop.OrderLine{{ProductID: productID, Quantity: 2}})
		if err != nil {
			return nil, err
		}
		_, err = shop.DeleteProduct(ctx, tx, productID)
		return nil, err
	})
	env.StartRunner(invoicing.Subscriber, nil)
	subscribertest.WaitFor(t, 10*time.Second, "the invoice", func() (bool, string) { return invoicesOf(env, orderID) == 1, "" })
	var lineSKU string
	if err := env.DB.Pool.QueryRow(ctx, `SELECT l.sku FROM invoice_lines l JOIN invoices i ON i.id = l.invoice_id WHERE i.order_id = $1`, orderID).Scan(&lineSKU); err != nil || lineSKU != sku {
		t.Errorf("invoice line sku %q (%v), want the snapshot %q", lineSKU, err, sku)
	}
}
