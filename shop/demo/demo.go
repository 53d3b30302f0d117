// Package demo drives a writer load through the shop writers at a fixed
// rate: the demo of `fanout up`, and the load of benchmarks and fault runs.
package demo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Mix is the share of each kind of write, in percent (they should sum to
// 100; whatever they leave over goes to brand renames).
type Mix struct {
	Price, Stock, Order, Create, Delete, RenameBrand int
	// RenameCategory renames a category: like a brand rename, it changes
	// the documents of all its products (a tenth of the catalog, with the
	// seed's ten categories), so a small share goes a long way.
	RenameCategory int
	// Lifecycle moves an open order on: paid, shipped, delivered, or (one
	// time in six) cancelled.
	Lifecycle int
	// Sale changes the prices of 2 to 8 products in one transaction: its
	// events enter the stream together with relay.atomic transaction.
	Sale int
}

// DefaultMix resembles a shop: mostly price and stock changes, some orders,
// now and then a brand or a category renamed.
var DefaultMix = Mix{Price: 39, Stock: 30, Order: 12, Lifecycle: 8, Create: 5, Delete: 3, RenameBrand: 2, RenameCategory: 1}

// Driver writes at Rate transactions per second until its context ends.
type Driver struct {
	Pool   *pgxpool.Pool
	Rate   int
	Mix    Mix
	Rand   *rand.Rand
	Logger *slog.Logger

	written atomic.Int64
	failed  atomic.Int64
}

// Written is the number of committed write transactions so far.
func (d *Driver) Written() int64 { return d.written.Load() }

// Failed is the number of write transactions that failed.
func (d *Driver) Failed() int64 { return d.failed.Load() }

// Run writes until ctx ends, then returns nil.
func (d *Driver) Run(ctx context.Context) error {
	if d.Rate <= 0 {
		return fmt.Errorf("demo rate must be positive (got %d)", d.Rate)
	}
	interval := time.Second / time.Duration(d.Rate)
	next := time.Now()
	for {
		next = next.Add(interval)
		if wait := time.Until(next); wait > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(wait):
			}
		} else if ctx.Err() != nil {
			return nil
		}
		// A write once begun finishes (bounded), even if ctx ends
		// meanwhile: a commit cut off by a cancellation may have happened
		// or not, and Written must count every write that did.
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeTimeout)
		err := d.writeOne(wctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			d.failed.Add(1)
			d.Logger.Warn("demo write failed", "error", err)
			continue
		}
		d.written.Add(1)
	}
}

// writeTimeout bounds one write of the driver.
const writeTimeout = 10 * time.Second

func (d *Driver) writeOne(ctx context.Context) error {
	op := d.Rand.IntN(100)
	m := d.Mix
	return pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
		switch {
		case op < m.Price:
			id, err := d.randomProduct(ctx, tx)
			if err != nil {
				return err
			}
			_, err = shop.UpdatePrice(ctx, tx, id, int64(1000+d.Rand.IntN(300000)))
			return err
		case op < m.Price+m.Stock:
			id, err := d.randomProduct(ctx, tx)
			if err != nil {
				return err
			}
			_, err = shop.ChangeStock(ctx, tx, id, d.Rand.IntN(41)-20)
			return err
		case op < m.Price+m.Stock+m.Order:
			lines := make([]shop.OrderLine, 1+d.Rand.IntN(3))
			for i := range lines {
				id, err := d.randomProduct(ctx, tx)
				if err != nil {
					return err
				}
				lines[i] = shop.OrderLine{ProductID: id, Quantity: 1 + d.Rand.IntN(3)}
			}
			_, _, err := shop.CreateOrder(ctx, tx, fmt.Sprintf("customer-%d", d.Rand.IntN(10000)), lines)
			return err
		case op < m.Price+m.Stock+m.Order+m.Create:
			p, err := shop.RandomProduct(ctx, tx, d.Rand)
			if err != nil {
				return err
			}
			_, err = shop.CreateProduct(ctx, tx, p)
			return err
		case op < m.Price+m.Stock+m.Order+m.Create+m.Delete:
			id, err := d.randomProduct(ctx, tx)
			if err != nil {
				return err
			}
			_, err = shop.DeleteProduct(ctx, tx, id)
			return err
		case op < m.Price+m.Stock+m.Order+m.Create+m.Delete+m.RenameCategory:
			var categoryID int64
			var name string
			if err := tx.QueryRow(ctx, `SELECT id, name FROM categories ORDER BY random() LIMIT 1`).Scan(&categoryID, &name); err != nil {
				return fmt.Errorf("pick category: %w", err)
			}
			_, err := shop.RenameCategory(ctx, tx, categoryID, renamed(name, d.Rand))
			return err
		case op < m.Price+m.Stock+m.Order+m.Create+m.Delete+m.RenameCategory+m.Lifecycle:
			return d.moveOrder(ctx, tx)
		case op < m.Price+m.Stock+m.Order+m.Create+m.Delete+m.RenameCategory+m.Lifecycle+m.Sale:
			return d.sale(ctx, tx)
		default:
			// Brand renames last, so that a mix written before category
			// renames existed draws the same writes from the same seed.
			var brandID int64
			var name string
			if err := tx.QueryRow(ctx, `SELECT id, name FROM brands ORDER BY random() LIMIT 1`).Scan(&brandID, &name); err != nil {
				return fmt.Errorf("pick brand: %w", err)
			}
			_, err := shop.RenameBrand(ctx, tx, brandID, renamed(name, d.Rand))
			return err
		}
	})
}

var errNoProducts = errors.New("no products: seed the catalog first")

// nextStatus is an open order's next step in its life.
var nextStatus = map[string]func(context.Context, pgx.Tx, int64) (int64, error){
	shop.StatusCreated: shop.PayOrder, shop.StatusPaid: shop.ShipOrder, shop.StatusShipped: shop.DeliverOrder,
}

// moveOrder takes one of the 8 newest open orders one step on (or cancels
// it), so an order lives its life in a few seconds, its events close
// together; with none open, it writes nothing.
func (d *Driver) moveOrder(ctx context.Context, tx pgx.Tx) error {
	var id int64
	var status string
	err := tx.QueryRow(ctx, `
SELECT id, status FROM orders WHERE status IN ('created', 'paid', 'shipped') ORDER BY id DESC LIMIT 1 OFFSET $1`,
		d.Rand.IntN(8)).Scan(&id, &status)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("pick an open order: %w", err)
	}
	move := nextStatus[status]
	if d.Rand.IntN(6) == 0 {
		move = shop.CancelOrder
	}
	if _, err = move(ctx, tx, id); errors.Is(err, shop.ErrTransition) {
		return nil // another writer moved it first
	}
	return err
}

// sale changes the prices of 2 to 8 products, in id order.
func (d *Driver) sale(ctx context.Context, tx pgx.Tx) error {
	ids := map[int64]bool{}
	for range 2 + d.Rand.IntN(7) {
		id, err := d.randomProduct(ctx, tx)
		if err != nil {
			return err
		}
		ids[id] = true
	}
	for _, id := range slices.Sorted(maps.Keys(ids)) {
		if _, err := shop.UpdatePrice(ctx, tx, id, int64(1000+d.Rand.IntN(300000))); err != nil {
			return err
		}
	}
	return nil
}

// randomProduct picks an existing product id cheaply: a random point in the
// id range, then the next id that exists.
func (d *Driver) randomProduct(ctx context.Context, tx pgx.Tx) (int64, error) {
	var lo, hi int64
	if err := tx.QueryRow(ctx, `SELECT coalesce(min(id), 0), coalesce(max(id), 0) FROM products`).Scan(&lo, &hi); err != nil {
		return 0, err
	}
	if hi == 0 {
		return 0, errNoProducts
	}
	var id int64
	err := tx.QueryRow(ctx, `SELECT id FROM products WHERE id >= $1 ORDER BY id LIMIT 1`, lo+d.Rand.Int64N(hi-lo+1)).Scan(&id)
	return id, err
}

// renamed gives a brand or a category a new name that keeps its root, so
// the catalog stays readable after many renames: "Acme" → "Acme 41807" →
// "Acme 903".
func renamed(name string, rng *rand.Rand) string {
	root := name
	if i := strings.LastIndexByte(name, ' '); i > 0 {
		if _, err := strconv.Atoi(name[i+1:]); err == nil {
			root = name[:i]
		}
	}
	return fmt.Sprintf("%s %d", root, 2+rng.IntN(1_000_000))
}
