package faultrun

// The effects against Postgres: invoices, the sales ledger, fulfilment's
// histories, the search documents and the cache.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/fanout/fanout/subscribers/orderstatus"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5"
)

// checkInvoices: exactly one invoice per order (but the planted order with
// a missing product, which has none), none for a rolled-back order.
func (r *run) checkInvoices(ctx context.Context) {
	rep, p := r.report, r.planted
	rows, err := r.pool().Query(ctx, `
SELECT o.id, count(DISTINCT i.id), bool_or(l.product_id = $1 AND l.sku IS NULL)
FROM orders o
LEFT JOIN invoices i ON i.order_id = o.id
LEFT JOIN order_lines l ON l.order_id = o.id
GROUP BY o.id`, missingProduct)
	if err != nil {
		rep.violate("2 (read the invoices)", err.Error())
		return
	}
	var wrong []string
	var id, n int64
	var plantedBad bool
	orders := 0
	_, err = pgx.ForEachRow(rows, []any{&id, &n, &plantedBad}, func() error {
		orders++
		if want := map[bool]int64{true: 0, false: 1}[plantedBad]; n != want {
			wrong = append(wrong, fmt.Sprintf("order %d has %d invoices, want %d", id, n, want))
		}
		return nil
	})
	if err != nil {
		rep.violate("2 (read the invoices)", err.Error())
		return
	}
	if orders == 0 {
		rep.violate("2 (invoices)", "no orders: the check proves nothing")
	}
	if len(wrong) > 0 {
		rep.violate("2 (exactly one invoice per order)", head(wrong))
	}
	var ghost int
	if err := r.pool().QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = ANY($1)`, p.rolledBack).Scan(&ghost); err != nil {
		rep.violate("4 (read the invoices)", err.Error())
	} else if ghost > 0 {
		rep.violate("4 (no invoice for rolled-back orders)", fmt.Sprintf("%d invoices for orders %v", ghost, p.rolledBack))
	}
}

// checkLedger: each product's sales ledger equals the sum of the lines of
// its committed orders. The ledger adds up, so an event handled twice (or
// lost) shows here even where a unique key would hide it.
func (r *run) checkLedger(ctx context.Context) {
	rep := r.report
	drift, err := salesledger.Drift(ctx, r.pool())
	if err != nil {
		rep.violate("2 (read the "+salesledger.Name+")", err.Error())
		return
	}
	if len(drift) > 0 {
		rep.violate("2 (each product's sales ledger equals its order lines: every order counted once)", head(drift))
	}
	var products int
	if err := r.pool().QueryRow(ctx, `SELECT count(*) FROM product_sales`).Scan(&products); err != nil || products == 0 {
		rep.violate("2 ("+salesledger.Name+")", fmt.Sprintf("an empty ledger (%v): the check proves nothing", err))
	}
}

// checkFulfilment: the ordered subscriber applied every order's
// transitions as they were committed, one at a time and in order, across
// its instances' crashes and the pin moving between them: its history
// equals order_transitions, and it recorded no violation (out of order,
// after a gap, after the order ended).
func (r *run) checkFulfilment(ctx context.Context) {
	if !slices.Contains(r.subscriberNames(), fulfilment.Name) {
		return
	}
	rep := r.report
	diffs, err := fulfilment.Compare(ctx, r.pool(), 10)
	if err != nil {
		rep.violate("8 (read "+fulfilment.Name+")", err.Error())
		return
	}
	if len(diffs) > 0 {
		rep.violate("8 (every order's applied history equals its committed history, no violation recorded)", head(diffs))
	}
	var moved int
	if err := r.pool().QueryRow(ctx, `SELECT count(*) FROM fulfilment_history WHERE n > 1`).Scan(&moved); err != nil || moved == 0 {
		rep.violate("8 ("+fulfilment.Name+")", fmt.Sprintf("no order moved past created (%v): the check proves nothing", err))
	}
	rep.Transitions = moved
}

// checkOrderStatus: the order status copy (a late subscriber, its state
// partly from its backfill) holds every order at its latest status and
// version: none lost, none regressed by a backfill event applied after a
// live one.
func (r *run) checkOrderStatus(ctx context.Context) {
	if !slices.Contains(r.subscriberNames(), orderstatus.Name) {
		return
	}
	rep := r.report
	diffs, err := orderstatus.Compare(ctx, r.pool(), 10)
	if err != nil {
		rep.violate("12 (read "+orderstatus.Name+")", err.Error())
		return
	}
	if len(diffs) > 0 {
		rep.violate("12 (every order's copy at its latest status and version: none lost, none regressed)", head(diffs))
	}
	var moved int
	if err := r.pool().QueryRow(ctx, `SELECT count(*) FROM order_status_copy WHERE version > 1`).Scan(&moved); err != nil || moved == 0 {
		rep.violate("12 ("+orderstatus.Name+")", fmt.Sprintf("no copy of an order past created (%v): the check proves nothing", err))
	}
}

// checkSearch: every search document equals its SQL join; no deleted
// product has one. The planted rejected products are, rightly, missing.
func (r *run) checkSearch(ctx context.Context) {
	rep, p := r.report, r.planted
	cur, err := searchindex.Current(ctx, r.search, r.alias)
	if err != nil || cur == "" {
		rep.violate("3 (search)", fmt.Sprintf("no index behind %s: %v", r.alias, err))
		return
	}
	if err := r.search.Refresh(ctx, cur); err != nil {
		rep.violate("3 (search)", err.Error())
		return
	}
	d, err := searchindex.Check(ctx, r.search, r.pool(), cur, 0)
	if err != nil {
		rep.violate("3 (search)", err.Error())
		return
	}
	var missing []int64
	for _, id := range d.Missing {
		if !p.rejectedProds[id] {
			missing = append(missing, id)
		}
	}
	if len(missing)+len(d.Different)+len(d.Extra) > 0 {
		rep.violate("3 (every document equals SQL, no deleted product indexed)",
			fmt.Sprintf("missing %v, different %v, deleted but indexed %v", cut(missing), cut(d.Different), cut(d.Extra)))
	}
}

// checkCache compares every cached product with SQL.
func (r *run) checkCache(ctx context.Context) {
	var stale []string
	iter := r.rdb.Scan(ctx, 0, "product:*", 1000).Iterator()
	for iter.Next(ctx) {
		key := iter.Val()
		val, err := r.rdb.Get(ctx, key).Result()
		if err != nil || val == "tombstone" {
			continue
		}
		versionText, _, _ := strings.Cut(val, "\n")
		cached, _ := strconv.ParseInt(versionText, 10, 64)
		id, _ := strconv.ParseInt(strings.TrimPrefix(key, "product:"), 10, 64)
		var current int64
		err = r.pool().QueryRow(ctx, `SELECT version FROM products WHERE id = $1`, id).Scan(&current)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			stale = append(stale, fmt.Sprintf("product %d deleted but cached at version %d", id, cached))
		case err != nil:
			stale = append(stale, fmt.Sprintf("product %d: %v", id, err))
		case cached < current:
			stale = append(stale, fmt.Sprintf("product %d cached at version %d, SQL has %d", id, cached, current))
		}
	}
	if err := iter.Err(); err != nil {
		r.report.violate("3 (read the cache)", err.Error())
	}
	if len(stale) > 0 {
		r.report.violate("3 (no cached product older than SQL)", head(stale))
	}
}
