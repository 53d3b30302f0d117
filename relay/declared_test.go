package relay

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/shop"
)

// Rows written behind the writers' back (another language, a psql prompt)
// are checked against the declared event types as the shop's writers'
// events are: a payload that breaks its type's schema is marked failed
// with the pointer and the rule it breaks, and the rows behind it are
// published; an undeclared type is published or failed as
// relay.undeclared_events says.
func TestRowsBreakingTheirDeclarationFail(t *testing.T) {
	for _, undeclared := range []string{UndeclaredPublish, UndeclaredFail} {
		t.Run("undeclared_events="+undeclared, func(t *testing.T) {
			forEachCapture(t, func(t *testing.T, h *harness) {
				ctx := context.Background()
				bad := []struct {
					row  rawRow
					want string // in the reason
				}{
					{rawRow{payload: `{"product_id": "12"}`}, `at /product_id, rule "type"`},
					{rawRow{payload: `{"price_cents": 5}`}, `rule "required"`},
					{rawRow{payload: `{"product_id": 12, "price_cents": -1}`}, `at /price_cents, rule "minimum"`},
					{rawRow{eventType: shop.OrderPaid, aggregateType: "order", payload: `{"order_id": 3, "from": "created", "to": "shipped", "n": 2}`}, `at /to, rule "const"`},
					{rawRow{payload: `[1, 2]`}, `rule "type"`},
					{rawRow{aggregateType: "order"}, `product.updated is declared for aggregate product, not "order"`},
				}
				if undeclared == UndeclaredFail {
					bad = append(bad, struct {
						row  rawRow
						want string
					}{rawRow{eventType: "test.undeclared", payload: `{"anything": true}`}, "event type not declared: test.undeclared"})
				}
				good := []rawRow{
					{},
					{payload: `{"product_id": 12, "price_cents": 0, "extra": "later versions may add properties"}`},
					{eventType: shop.OrderPaid, aggregateType: "order", payload: `{"order_id": 3, "from": "created", "to": "paid", "n": 2}`},
				}
				if undeclared == UndeclaredPublish {
					good = append(good, rawRow{eventType: "test.undeclared", payload: `{"anything": true}`})
				}

				cfg := h.cfg.Relay
				cfg.UndeclaredEvents = undeclared
				r, err := New(Options{Relay: cfg, Stream: h.cfg.Stream, Pool: h.db.Pool, Conn: h.connect(), Logger: testLogger(t), EventTypes: shop.EventTypes})
				if err != nil {
					t.Fatal(err)
				}
				if h.wal() {
					r.cfg.Slot = h.db.Name
				}
				reasons := map[int64]string{} // a bad row's id: what its reason must say
				h.launch(r, func() {
					// Each bad row first, a good one behind it.
					for i := range max(len(bad), len(good)) {
						if i < len(bad) {
							id, err := insertRaw(ctx, h.db.Pool, bad[i].row.withDefaults())
							if err != nil {
								t.Fatal(err)
							}
							reasons[id] = bad[i].want
						}
						if i < len(good) {
							if _, err := insertRaw(ctx, h.db.Pool, good[i].withDefaults()); err != nil {
								t.Fatal(err)
							}
						}
					}
				})
				published := func() int { return statusCounts(t, h.db.Pool)["sent"] }
				if h.wal() {
					published = h.streamCount
				}
				waitFor(t, 20*time.Second, fmt.Sprintf("%d published and %d failed", len(good), len(bad)), func() (bool, string) {
					c := statusCounts(t, h.db.Pool)
					return published() == len(good) && c["failed"] == len(bad), formatCounts(c) + fmt.Sprintf(" published=%d", published())
				})
				for id, want := range reasons {
					var status, reason string
					if err := h.db.Pool.QueryRow(ctx, `SELECT status, coalesce(last_error, '') FROM outbox WHERE id = $1`, id).Scan(&status, &reason); err != nil {
						t.Fatal(err)
					}
					t.Logf("row %d: %s", id, reason)
					if status != "failed" || !strings.Contains(reason, fmt.Sprintf("outbox row %d:", id)) || !strings.Contains(reason, want) {
						t.Errorf("row %d is %s with %q, want failed with its id and %q", id, status, reason, want)
					}
				}
				if got := len(h.streamMessages()); got != len(good) {
					t.Errorf("the stream holds %d messages, want the %d good rows", got, len(good))
				}
			})
		})
	}
}
