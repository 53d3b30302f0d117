// Package orderstatus is a subscriber that keeps a copy of each order's
// status and version (its number of transitions): the state a new
// subscriber must end with after a backfill beside live writers, with no
// order missing and none older than Postgres.
//
// It is a test subscriber, not in the shipped registry: binaries built with
// the fanout_orderstatus tag add it, and its table is made by the tests
// (CreateTable), not by a migration. The backfill tests and the fault run's
// late join use it, because, unlike invoicing, its state changes with every
// event, so a backfill that applied an old state over a new one would show.
//
// An event only names its order: the handler reads the order's status and
// version from Postgres and writes them only over an older version, so a
// backfill's event and a live event of one order may apply in either order
// and the copy still ends at the latest.
package orderstatus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Name is the durable consumer's name.
const Name = "orderstatus"

// Subscriber is the declaration the registry lists (in a binary built with
// the fanout_orderstatus tag).
var Subscriber = subscribers.Declaration{
	Name:       Name,
	EventTypes: []string{"order.>"},
	Grants: []string{
		"SELECT ON orders, order_transitions",
		"SELECT, INSERT, UPDATE ON order_status_copy",
	},
	// A new copy starts from every order in Postgres: an order.created
	// per order, naming it; the handler reads the rest.
	Backfill: &subscribers.Backfill{
		Table: "orders", Key: "id", EventType: shop.OrderCreated, AggregateType: shop.AggregateOrder,
		Payload: "jsonb_build_object('order_id', t.id)",
	},
	New: func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Tx(&Handler{}), nil },
}

// ErrMalformed is the reason an event goes to the dead letters.
var ErrMalformed = errors.New("malformed order event")

const (
	createTableSQL = `CREATE TABLE IF NOT EXISTS order_status_copy (
    order_id bigint PRIMARY KEY,
    status   text NOT NULL,
    version  int NOT NULL
)`

	// readSQL: the order's status and version, as Postgres has them now.
	readSQL = `SELECT o.status, (SELECT coalesce(max(n), 0) FROM order_transitions t WHERE t.order_id = o.id) FROM orders o WHERE o.id = $1`

	// putSQL writes the copy over an older version only.
	putSQL = `INSERT INTO order_status_copy AS c (order_id, status, version) VALUES ($1, $2, $3)
ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, version = excluded.version
WHERE c.version < excluded.version`

	// overwriteSQL writes the copy whatever its version: the flaw.
	overwriteSQL = `INSERT INTO order_status_copy AS c (order_id, status, version) VALUES ($1, $2, $3)
ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, version = excluded.version`
)

// CreateTable makes the copy's table (a test's setup: the subscriber is
// not shipped, so no migration makes it).
func CreateTable(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}) error {
	_, err := q.Exec(ctx, createTableSQL)
	return err
}

// Handler keeps the copy.
type Handler struct {
	// Unguarded writes over a newer version too: the flaw a test shows
	// Compare catching. Nothing sets it outside tests.
	Unguarded bool
	// BeforeWrite, if set, runs between the read and the write (tests
	// make a live event land there).
	BeforeWrite func(ev subscribers.Event, orderID int64)
}

// HandleTx copies the order the event names, as Postgres has it now.
func (h *Handler) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	orderID, err := OrderID(ev)
	if err != nil {
		return err
	}
	var status string
	var version int
	err = tx.QueryRow(ctx, readSQL, orderID).Scan(&status, &version)
	if errors.Is(err, pgx.ErrNoRows) {
		return subscribers.Permanent(fmt.Errorf("order %d does not exist", orderID))
	}
	if err != nil {
		return err
	}
	if h.BeforeWrite != nil {
		h.BeforeWrite(ev, orderID)
	}
	if h.Unguarded {
		return Overwrite(ctx, tx, orderID, status, version)
	}
	_, err = tx.Exec(ctx, putSQL, orderID, status, version)
	return err
}

// OrderID is the order an event names, or a permanent error.
func OrderID(ev subscribers.Event) (int64, error) {
	var p struct {
		OrderID int64 `json:"order_id"`
	}
	if err := json.Unmarshal(ev.Payload, &p); err != nil || p.OrderID <= 0 {
		return 0, subscribers.Permanent(fmt.Errorf("%w %.100q", ErrMalformed, ev.Payload))
	}
	return p.OrderID, nil
}

// Overwrite writes an order's copy whatever version it holds: the flaw
// that tests and the fault run's sabotaged build use to prove that Compare
// reports a regressed order.
func Overwrite(ctx context.Context, tx pgx.Tx, orderID int64, status string, version int) error {
	_, err := tx.Exec(ctx, overwriteSQL, orderID, status, version)
	return err
}

// compareSQL: every order whose copy is missing or differs, and every copy
// of an order Postgres does not have.
const compareSQL = `
WITH truth AS (
    SELECT o.id, o.status, (SELECT coalesce(max(n), 0) FROM order_transitions t WHERE t.order_id = o.id) AS version FROM orders o
)
SELECT coalesce(t.id, c.order_id), t.status, t.version, c.status, c.version
FROM truth t FULL JOIN order_status_copy c ON c.order_id = t.id
WHERE t.id IS NULL OR c.order_id IS NULL OR c.status <> t.status OR c.version IS DISTINCT FROM t.version
ORDER BY 1
LIMIT $1`

// Compare compares the copy with Postgres and describes up to limit
// differences: an order missing from the copy (lost), a copy older than
// the order (regressed), or any other difference.
func Compare(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, limit int) ([]string, error) {
	rows, err := q.Query(ctx, compareSQL, limit)
	if err != nil {
		return nil, fmt.Errorf("compare the order status copy: %w", err)
	}
	var diffs []string
	var id int64
	var status, copyStatus *string
	var version, copyVersion *int
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &version, &copyStatus, &copyVersion}, func() error {
		switch {
		case copyStatus == nil:
			diffs = append(diffs, fmt.Sprintf("order %d (%s, version %d) missing from the copy", id, *status, deref(version)))
		case status == nil:
			diffs = append(diffs, fmt.Sprintf("order %d is not in Postgres, its copy %s (version %d)", id, *copyStatus, *copyVersion))
		default:
			diffs = append(diffs, fmt.Sprintf("order %d is %s (version %d), its copy %s (version %d)", id, *status, deref(version), *copyStatus, *copyVersion))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("compare the order status copy: %w", err)
	}
	return diffs, nil
}

func deref(n *int) int {
	if n == nil {
		return 0
	}
	return *n
}
