//go:build fanout_sabotage

package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/orderstatus"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/jackc/pgx/v5"
)

// The kinds of FANOUT_TEST_SABOTAGE. Each breaks one guarantee the fault
// run's checker must then report.
func init() {
	kind := os.Getenv("FANOUT_TEST_SABOTAGE")
	if kind == "" {
		return
	}
	if !sabotageRelay(kind) && !sabotageSubscribers(kind) && !sabotageBackfill(kind) {
		fmt.Fprintf(os.Stderr, "fanout: unknown FANOUT_TEST_SABOTAGE %q\n", kind)
		os.Exit(2)
	}
	fmt.Fprintf(os.Stderr, "fanout: SABOTAGED BUILD: %s (a test of the fault run's checker)\n", kind)
}

// sabotageRelay sets up kind if it is a relay's sabotage, and says whether
// it was.
func sabotageRelay(kind string) bool {
	switch kind {
	case "relay-skips-publish":
		// One row in 100 is marked sent without being published (a
		// selftest run writes several hundred rows: a rarer sabotage could
		// touch none of them).
		sabotage.relay.SkipPublish = func(id int64) bool { return id%100 == 0 }
	case "relay-no-audit":
		// No auditor: the events JetStream loses after their PubAck (the
		// fault run rolls a server's store back) stay lost.
		sabotage.relay.NoAudit = true
	case "relay-splits-transactions":
		// With relay.atomic transaction, each transaction's events go in
		// two atomic batches, 200 ms apart: other transactions' events
		// land between them.
		sabotage.relay.SplitTransactions = true
	case "relay-unordered":
		// The relays publish an aggregate's events without waiting for
		// the earlier ones, and one publish in 5 fails once and is
		// retried after a backoff: later events overtake it.
		sabotage.relay.Unordered = true
		var tried sync.Map
		sabotage.relay.FailPublish = func(id int64) bool {
			_, again := tried.LoadOrStore(id, true)
			return id%5 == 0 && !again
		}
	default:
		return false
	}
	return true
}

// sabotageSubscribers sets up kind if it is a subscriber's sabotage, and
// says whether it was.
func sabotageSubscribers(kind string) bool {
	switch kind {
	case "subscriber-unordered":
		// Ordered subscribers take their events as they come, and one
		// event in 5 fails for a few seconds (retried after a backoff):
		// an order's later transitions overtake it.
		sabotage.subscriber.Unordered = true
		sabotage.handler = func(d subscribers.Declaration, h subscribers.Handler) subscribers.Handler {
			if th, ok := h.TxHandler(); ok && d.Ordered {
				return subscribers.Tx(&failOnce{TxHandler: th})
			}
			return h
		}
	case "ack-before-commit":
		// Subscribers whose effect is in Postgres ack a batch before its
		// transaction commits: a process killed in between loses it. Two
		// seconds between them: at 200 ms, and again at 1 s (a loaded CI
		// host, 213 writes in the 25 s run), a run's seven kills all
		// missed the windows once.
		sabotage.subscriber.AckBeforeCommit = 2 * time.Second
	case "handle-twice":
		// The sales ledger handles one event in 5 twice (a selftest run
		// has some eighty orders: one in 25 missed them all now and then).
		sabotage.handler = func(_ subscribers.Declaration, h subscribers.Handler) subscribers.Handler {
			if l, ok := h.Unwrap().(salesledger.Handler); ok {
				return subscribers.Tx(twice{l})
			}
			return h
		}
	default:
		return false
	}
	return true
}

// sabotageBackfill sets up kind if it is a backfill's sabotage, and says
// whether it was.
func sabotageBackfill(kind string) bool {
	switch kind {
	case "backfill-skips-rows":
		// A backfill that moves its checkpoint past one row in 3 without
		// handing it to the handler: those orders never get an invoice.
		sabotage.backfill = func(h subscribers.Handler) subscribers.Handler {
			if th, ok := h.TxHandler(); ok {
				return subscribers.Tx(skipRows{th})
			}
			return h
		}
	case "backfill-regresses":
		// The order status copy's backfill applies each order as its
		// creation, over whatever the copy holds (a handler that takes the
		// backfill's order.created at its word): every order the live
		// events had moved on regresses to created.
		sabotage.backfill = func(h subscribers.Handler) subscribers.Handler {
			if _, ok := h.Unwrap().(*orderstatus.Handler); ok {
				return subscribers.Tx(asCreated{&orderstatus.Handler{}})
			}
			return h
		}
	default:
		return false
	}
	return true
}

// twice runs the ledger's handler a second time on some events, in the
// same transaction: the effect a lost checkpoint would have.
type twice struct{ salesledger.Handler }

func again(ev subscribers.Event) bool { return ev.ID%5 == 0 }

func (t twice) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	if err := t.Handler.HandleTx(ctx, tx, ev); err != nil || !again(ev) {
		return err
	}
	return t.Handler.HandleTx(ctx, tx, ev)
}

func (t twice) HandleBatchTx(ctx context.Context, tx pgx.Tx, evs []subscribers.Event) error {
	if err := t.Handler.HandleBatchTx(ctx, tx, evs); err != nil {
		return err
	}
	for _, ev := range evs {
		if again(ev) {
			if err := t.Handler.HandleTx(ctx, tx, ev); err != nil {
				return err
			}
		}
	}
	return nil
}

// failOnce fails every attempt on one event in 5 during the failFor after
// its first: an order moves on every couple of seconds in the fault run's
// load, so its next transition arrives while this one is held, whatever
// the retry backoff (a single failure retried after 200ms was overtaken
// only when a relay's restart happened to publish both at once). The
// attempts in that window stay well under subscribers.max_failures.
type failOnce struct {
	subscribers.TxHandler
	first sync.Map // event id -> time of its first attempt
}

const failFor = 4 * time.Second

func (f *failOnce) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	first, _ := f.first.LoadOrStore(ev.ID, time.Now())
	if ev.ID%5 == 0 && time.Since(first.(time.Time)) < failFor {
		return fmt.Errorf("sabotage: event %d fails for %s", ev.ID, failFor)
	}
	return f.TxHandler.HandleTx(ctx, tx, ev)
}

// skipRows drops one backfill row in 3, by its key.
type skipRows struct{ subscribers.TxHandler }

func skipped(ev subscribers.Event) bool {
	_, key, _ := strings.Cut(ev.Headers.Get(subscribers.BackfillHeader), ":")
	n, _ := strconv.ParseInt(key, 10, 64)
	return n%3 == 0
}

func (s skipRows) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	if skipped(ev) {
		return nil
	}
	return s.TxHandler.HandleTx(ctx, tx, ev)
}

// asCreated writes every order it is handed as just created.
type asCreated struct{ *orderstatus.Handler }

func (asCreated) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	id, err := orderstatus.OrderID(ev)
	if err != nil {
		return err
	}
	return orderstatus.Overwrite(ctx, tx, id, shop.StatusCreated, 1)
}
