package faultrun

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/jackc/pgx/v5"
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// Kinds of planted input, as the report names them.
const (
	plantedMalformed      = "payload breaking its declared schema (order.created)"
	plantedBadType        = "unknown event type (not a valid subject)"
	plantedOversized      = "payload over NATS max payload"
	plantedMissingProduct = "order line referencing a missing product"
	plantedRejected       = "product document the search mapping rejects"
	plantedRolledBack     = "rolled-back order"
	plantedBadHeaders     = "headers that are not a JSON object of strings"
)

// expectedLetter is a dead letter a planted input must produce.
type expectedLetter struct {
	kind   string // planted kind
	reason string // a substring of the dead letter's reason
	// product, for a product the search mapping rejects: the load may
	// delete it before the indexer reaches the event, which the indexer
	// then rightly handles as a deletion (it indexes current state).
	product int64
}

// planted remembers the bad input and where each must end.
type planted struct {
	mu             sync.Mutex
	failedRows     map[int64]string                    // outbox id -> substring of its last_error
	letters        map[string]map[int64]expectedLetter // subscriber -> event id -> the dead letter it must get
	rejectedProds  map[int64]bool                      // products the search mapping refuses
	rejectedBrands map[int64]bool                      // their brands (a rename reindexes them)
	rejectedCats   map[int64]bool                      // their categories (likewise)
	rolledBack     []int64                             // order ids of rolled-back transactions
	kinds          map[string]int
}

func newPlanted() *planted {
	return &planted{failedRows: map[int64]string{}, letters: map[string]map[int64]expectedLetter{},
		rejectedProds: map[int64]bool{}, rejectedBrands: map[int64]bool{}, rejectedCats: map[int64]bool{}, kinds: map[string]int{}}
}

func (p *planted) note(kind string) {
	p.mu.Lock()
	p.kinds[kind]++
	p.mu.Unlock()
}

// expect records that subscriber must dead-letter event id with reason.
func (p *planted) expect(subscriber string, id int64, kind, reason string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.letters[subscriber] == nil {
		p.letters[subscriber] = map[int64]expectedLetter{}
	}
	p.letters[subscriber][id] = expectedLetter{kind: kind, reason: reason}
}

// A valid JSON payload of the wrong shape, written by a writer not
// checked against the declarations (another language, the plain
// outbox.Write): the relay marks it failed, naming the rule it breaks, and
// no subscriber sees it. (That a subscriber dead-letters such a payload,
// from a relay with no declarations, is the conformance suite's
// PermanentErrorReachesDeadLettersWithReason.)
func (r *run) plantMalformedOrder(ctx context.Context) error {
	var id int64
	err := inTx(ctx, r.pool(), func(tx pgx.Tx) error {
		var err error
		// An aggregate of its own: a failed event holds its aggregate's
		// later events, and the run checks that it holds no other's.
		id, err = outbox.Write(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: "planted-" + strconv.Itoa(r.plantRand.intn(1<<30)), Type: shop.OrderCreated,
			Payload: json.RawMessage(`{"order_id": "forty-two"}`)})
		return err
	})
	if err == nil {
		r.planted.mu.Lock()
		r.planted.failedRows[id] = `does not match its schema (version 1): at /order_id, rule "type"`
		r.planted.mu.Unlock()
		r.planted.note(plantedMalformed)
	}
	return err
}

// An event type NATS cannot carry, written behind the writer API's back:
// the relay marks it failed. Each poison row is an aggregate of its own:
// a failed event holds its aggregate's later events (relay.on_failed
// hold, tested in package relay), and the run checks that it holds no
// other aggregate's.
func (r *run) plantBadEventType(ctx context.Context) error {
	var id int64
	err := r.pool().QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('product', 'planted-' || gen_random_uuid(), 'product teleported', '{"product_id": 1}') RETURNING id`).Scan(&id)
	if err == nil {
		r.planted.mu.Lock()
		r.planted.failedRows[id] = "event type"
		r.planted.mu.Unlock()
		r.planted.note(plantedBadType)
	}
	return err
}

// Headers a writer in another language might store: not strings. The
// relay marks the row failed (it used to leave it and every row after it
// stuck in `sending`).
func (r *run) plantBadHeaders(ctx context.Context) error {
	var id int64
	err := r.pool().QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('product', 'planted-' || gen_random_uuid(), 'product.updated', '{"product_id": 1}', '{"retry": 1}') RETURNING id`).Scan(&id)
	if err == nil {
		r.planted.mu.Lock()
		r.planted.failedRows[id] = "headers"
		r.planted.mu.Unlock()
		r.planted.note(plantedBadHeaders)
	}
	return err
}

// A payload over NATS's max_payload: failed.
func (r *run) plantOversized(ctx context.Context) error {
	var id int64
	err := r.pool().QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('product', 'planted-' || gen_random_uuid(), 'product.updated', jsonb_build_object('product_id', 1, 'blob', repeat('x', 1100000))) RETURNING id`).Scan(&id)
	if err == nil {
		r.planted.mu.Lock()
		r.planted.failedRows[id] = "max_payload"
		r.planted.mu.Unlock()
		r.planted.note(plantedOversized)
	}
	return err
}

// An order whose line names a product that does not exist (no snapshot):
// invoicing dead-letters it; the ledger counts it (it keeps sales by
// product id, whatever became of the product).
func (r *run) plantOrderWithMissingProduct(ctx context.Context) error {
	var id int64
	err := inTx(ctx, r.pool(), func(tx pgx.Tx) error {
		var orderID int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (customer) VALUES ('chaos') RETURNING id`).Scan(&orderID); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO order_lines (order_id, line_no, product_id, quantity, unit_price) VALUES ($1, 1, $2, 1, 1)`, orderID, missingProduct); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO order_transitions (order_id, n, to_status) VALUES ($1, 1, 'created')`, orderID); err != nil {
			return err
		}
		var err error
		id, err = outbox.Write(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: strconv.FormatInt(orderID, 10), Type: shop.OrderCreated,
			Payload: shop.OrderEvent{OrderID: orderID, Customer: "chaos", Lines: 1}})
		return err
	})
	if err == nil {
		r.planted.expect(invoicing.Name, id, plantedMissingProduct, invoicing.ErrMissingProduct.Error())
		r.planted.note(plantedMissingProduct)
	}
	return err
}

// missingProduct is the product id planted order lines name.
const missingProduct = 987654321

// A product the search mapping refuses (a sku over Lucene's term limit):
// the indexer dead-letters the events about it.
func (r *run) plantRejectedProduct(ctx context.Context) error {
	var productID, brandID, categoryID, eventID int64
	err := inTx(ctx, r.pool(), func(tx pgx.Tx) error {
		p, err := shop.RandomProduct(ctx, tx, rand.New(rand.NewPCG(uint64(r.plantRand.intn(1<<30)), 5)))
		if err != nil {
			return err
		}
		p.SKU = strings.Repeat("R", 40000) + strconv.Itoa(r.plantRand.intn(1<<30))
		brandID, categoryID = p.BrandID, p.CategoryID
		if productID, err = shop.CreateProduct(ctx, tx, p); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT max(id) FROM outbox WHERE event_type = $1 AND aggregate_id = $2`,
			shop.ProductCreated, strconv.FormatInt(productID, 10)).Scan(&eventID)
	})
	if err == nil {
		r.planted.mu.Lock()
		r.planted.rejectedProds[productID] = true
		r.planted.rejectedBrands[brandID] = true
		r.planted.rejectedCats[categoryID] = true
		r.planted.mu.Unlock()
		r.planted.expect("searchindex", eventID, plantedRejected, "document "+strconv.FormatInt(productID, 10)+" rejected by index")
		r.planted.mu.Lock()
		l := r.planted.letters["searchindex"][eventID]
		l.product = productID
		r.planted.letters["searchindex"][eventID] = l
		r.planted.mu.Unlock()
		r.planted.note(plantedRejected)
	}
	return err
}

// An order created and rolled back: its id must never be invoiced.
func (r *run) rolledBackOrder(ctx context.Context) error {
	tx, err := r.pool().Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck
	var productID int64
	if err := tx.QueryRow(ctx, `SELECT id FROM products ORDER BY id LIMIT 1`).Scan(&productID); err != nil {
		return err
	}
	orderID, _, err := shop.CreateOrder(ctx, tx, "rolled back", []shop.OrderLine{{ProductID: productID, Quantity: 1}})
	if err != nil {
		return err
	}
	if err := tx.Rollback(ctx); err != nil {
		return err
	}
	r.planted.mu.Lock()
	r.planted.rolledBack = append(r.planted.rolledBack, orderID)
	r.planted.mu.Unlock()
	r.planted.note(plantedRolledBack)
	return nil
}

// bulkEvents is the least a bulk repricing writes: over the 1000 events
// of an atomic batch, so relays publish it in chunks.
const bulkEvents = 2500

// bulkReprice changes every product's price, several times each, in one
// transaction of at least bulkEvents events (a backfill done in SQL): a
// relay publishes it in chunks, each product's events spread over them.
func (r *run) bulkReprice(ctx context.Context) (events int, err error) {
	err = pgx.BeginFunc(ctx, r.db.Pool, func(tx pgx.Tx) error {
		// Locked first, in id order: no product goes from under it.
		rows, err := tx.Query(ctx, `SELECT id FROM products ORDER BY id FOR UPDATE`)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil || len(ids) == 0 {
			return err
		}
		events = 0
		for events < bulkEvents {
			for _, id := range ids {
				if _, err := shop.UpdatePrice(ctx, tx, id, int64(100+r.plantRand.intn(100_000))); err != nil {
					return err
				}
				events++
			}
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return events, nil
}
