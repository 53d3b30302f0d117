package operator_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/operator"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func orderEvent(orderID int64) outbox.Event {
	return outbox.Event{AggregateType: shop.AggregateOrder, AggregateID: strconv.FormatInt(orderID, 10), Type: shop.OrderCreated,
		Payload: shop.OrderEvent{OrderID: orderID, Customer: "test", Lines: 1}}
}

// Dead letters of orders that did not exist yet: listed, counted, a forged
// one refused, one discarded, the others redriven once their orders exist,
// every action in the audit trail; and the status reports it all.
func TestDeadLettersAndStatus(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := subscribertest.NewEnv(t)
	cfg := env.Config

	// A status before anything ran: no stream, every known subscriber
	// without a consumer.
	st, err := operator.ReadStatus(ctx, operator.Sources{Pool: env.DB.Pool, JS: env.JS, Stream: cfg.Stream, Subscribers: cfg.Subscribers, Known: []string{"later"}})
	if err != nil {
		t.Fatal(err)
	}
	if i := indexOf(st, "later"); i < 0 || !st.Subscribers[i].ConsumerGone {
		t.Errorf("a known subscriber without a consumer: %+v", st.Subscribers)
	}
	if len(st.Outbox.Unnumbered) != 0 {
		t.Errorf("a new database's outbox skips numbering %q", st.Outbox.Unnumbered)
	}

	// Three orders invoicing does not find: three dead letters.
	const missing = 1 << 40
	ids := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		return []outbox.Event{orderEvent(missing), orderEvent(missing + 1), orderEvent(missing + 2)}, nil
	})
	env.StartRunner(invoicing.Subscriber, nil)
	subscribertest.WaitFor(t, 30*time.Second, "three dead letters", func() (bool, string) {
		n := len(env.DeadLetters(invoicing.Name))
		return n == 3, strconv.Itoa(n)
	})
	env.WaitIdle(invoicing.Name, 15*time.Second)
	// A letter that speaks for invoicing, published by someone else under
	// another subscriber's name.
	forged := nats.NewMsg(cfg.Subscribers.DeadLetterSubjectPrefix + ".salesledger." + shop.OrderCreated)
	forged.Data = []byte(`{}`)
	forged.Header.Set(subscribers.DeadSubscriberHeader, invoicing.Name)
	forged.Header.Set(wire.EventIDHeader, strconv.FormatInt(ids[0], 10))
	if _, err := env.JS.PublishMsg(ctx, forged); err != nil {
		t.Fatal(err)
	}

	dl, err := operator.OpenDeadLetters(ctx, env.DB.Pool, env.JS, cfg.Stream, cfg.Subscribers)
	if err != nil {
		t.Fatal(err)
	}
	all, err := dl.List(ctx, "")
	if err != nil || len(all) != 4 {
		t.Fatalf("list: %d letters (%v), want 4", len(all), err)
	}
	letters, err := dl.List(ctx, invoicing.Name)
	if err != nil || len(letters) != 3 {
		t.Fatalf("invoicing's letters: %d (%v)", len(letters), err)
	}
	for i, l := range letters {
		if l.Refused != "" || l.Resolved != "" || l.EventID != strconv.FormatInt(ids[i], 10) || !strings.Contains(l.Reason, invoicing.ErrUnknownOrder.Error()) || !l.Vouched {
			t.Errorf("letter %d: %+v", i, l)
		}
	}
	forgedLetter := all[3]
	if forgedLetter.Subscriber != "salesledger" || !strings.Contains(forgedLetter.Refused, "may not speak for another") || forgedLetter.Vouched {
		t.Errorf("the forged letter: subscriber %q, refused %q, vouched %t", forgedLetter.Subscriber, forgedLetter.Refused, forgedLetter.Vouched)
	}
	// No subscriber vouches for it: it is left without a reason, and does
	// not stop the others.
	if n, left, err := dl.Discard(ctx, []operator.Letter{forgedLetter}, ""); err != nil || n != 0 || len(left) != 1 {
		t.Errorf("discard of the forged letter without a reason: %d discarded, left %v (%v)", n, left, err)
	}

	// One discarded: resolved, no longer counted.
	if n, left, err := dl.Discard(ctx, letters[:1], "ada"); err != nil || n != 1 || len(left) != 0 {
		t.Fatalf("discard: %d, left %v (%v)", n, left, err)
	}
	counts, err := operator.Counts(ctx, env.DB.Pool, env.JS, cfg.Subscribers)
	if err != nil || counts[invoicing.Name] != 2 || counts["salesledger"] != 1 {
		t.Errorf("counts after a discard: %v (%v), want invoicing 2 and the forged letter's 1", counts, err)
	}
	var role string
	if err := env.DB.Pool.QueryRow(ctx, `SELECT session_user`).Scan(&role); err != nil {
		t.Fatal(err)
	}
	again, err := dl.Get(ctx, letters[0].Seq)
	if err != nil || !strings.HasPrefix(again.Resolved, "discard by "+role+" (ada) at ") {
		t.Errorf("the discarded letter: resolved %q (%v), want by the session's role %s", again.Resolved, err, role)
	}

	// The orders appear; the other two are redriven to invoicing alone.
	var orderIDs []int64
	err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		for _, id := range []int64{missing + 1, missing + 2} {
			if _, err := tx.Exec(ctx, `INSERT INTO orders (id, customer) OVERRIDING SYSTEM VALUE VALUES ($1, 'late')`, id); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO order_lines (order_id, line_no, product_id, sku, name, quantity, unit_price) VALUES ($1, 1, 1, 'S', 'thing', 2, 5)`, id); err != nil {
				return err
			}
			orderIDs = append(orderIDs, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	runner := env.NewRunner(invoicing.Subscriber, nil)
	runnerOf := func(name string) (*subscribers.Runner, error) {
		if name != invoicing.Name {
			t.Fatalf("redrive asked for subscriber %s", name)
		}
		return runner, nil
	}
	letters, err = dl.List(ctx, invoicing.Name)
	if err != nil {
		t.Fatal(err)
	}
	done, err := dl.Redrive(ctx, letters, runnerOf, false, "ada")
	if err != nil || len(done) != 3 {
		t.Fatalf("redrive: %+v (%v)", done, err)
	}
	if !done[0].Skipped || done[1].Outcome != operator.OutcomeHandled || done[2].Outcome != operator.OutcomeHandled {
		t.Errorf("redrive outcomes: %+v", done)
	}
	// Postgres is the truth: the outbox still holds the events.
	if done[1].Source != operator.SourceOutbox || done[2].Source != operator.SourceOutbox {
		t.Errorf("redriven from %q and %q, want %q", done[1].Source, done[2].Source, operator.SourceOutbox)
	}
	var invoices int
	if err := env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = ANY($1)`, orderIDs).Scan(&invoices); err != nil || invoices != 2 {
		t.Errorf("invoices after the redrive: %d (%v)", invoices, err)
	}
	var actions int
	if err := env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM dead_letter_actions WHERE comment = 'ada' AND actor = session_user`).Scan(&actions); err != nil || actions != 3 {
		t.Errorf("audit trail: %d actions by %s saying ada (%v), want a discard and two redrives", actions, role, err)
	}

	if err := outboxstore.New(env.DB.Pool).SetNumbering(ctx, []string{"product.updated"}); err != nil {
		t.Fatal(err)
	}
	st, err = operator.ReadStatus(ctx, operator.Sources{Pool: env.DB.Pool, JS: env.JS, Stream: cfg.Stream, Subscribers: cfg.Subscribers, Known: []string{invoicing.Name}})
	if err != nil {
		t.Fatal(err)
	}
	i := indexOf(st, invoicing.Name)
	if st.Stream.Missing || st.Stream.Messages != 3 || i < 0 || st.Subscribers[i].DeadLetters != 0 || st.Subscribers[i].Checkpoint != 2 ||
		st.Subscribers[i].ConsumerGone || st.Outbox.Sent != 3 || !slices.Equal(st.Outbox.Unnumbered, []string{"product.updated"}) {
		t.Errorf("status: %+v", st)
	}
}

// Letters in a subscriber's own name, as any holder of its NATS
// credential can publish them: one naming an event that never was (no
// outbox row, a stream sequence the stream never held), one naming a real
// event the subscriber never dead-lettered, one naming the subscriber's
// real dead letter with a changed body. None is handed to the handler as
// the letter says: the first two are refused, the third redrives the real
// event from its outbox row. A real letter is discarded without a reason,
// a forged one only with one; and the audit trail takes no "handled" for an
// event the subscriber has no checkpoint of.
func TestForgedLettersAreNotRedriven(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := subscribertest.NewEnv(t)
	cfg := env.Config
	ids := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) { return []outbox.Event{orderEvent(1 << 41)}, nil })
	env.StartRunner(invoicing.Subscriber, nil)
	subscribertest.WaitFor(t, 30*time.Second, "the real dead letter", func() (bool, string) {
		return len(env.DeadLetters(invoicing.Name)) == 1, ""
	})
	env.WaitIdle(invoicing.Name, 15*time.Second)
	dl, err := operator.OpenDeadLetters(ctx, env.DB.Pool, env.JS, cfg.Stream, cfg.Subscribers)
	if err != nil {
		t.Fatal(err)
	}
	letters, err := dl.List(ctx, invoicing.Name)
	if err != nil || len(letters) != 1 {
		t.Fatalf("letters: %d (%v)", len(letters), err)
	}
	real := letters[0]
	if !real.Vouched || !real.Intact {
		t.Fatalf("the real letter: vouched %t, intact %t", real.Vouched, real.Intact)
	}
	realSeq := real.Raw.Header.Get(subscribers.DeadStreamSeqHeader)

	forge := func(id int64, seq, body string) {
		t.Helper()
		m := nats.NewMsg(cfg.Subscribers.DeadLetterSubjectPrefix + "." + invoicing.Name + "." + shop.OrderCreated)
		m.Data = []byte(body)
		m.Header.Set(subscribers.DeadSubscriberHeader, invoicing.Name)
		m.Header.Set(wire.EventIDHeader, strconv.FormatInt(id, 10))
		m.Header.Set(wire.EventTypeHeader, shop.OrderCreated)
		m.Header.Set(subscribers.DeadSubjectHeader, cfg.Stream.SubjectPrefix+"."+shop.OrderCreated)
		m.Header.Set(subscribers.DeadStreamSeqHeader, seq)
		if _, err := env.JS.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	// A real event invoicing handles: the second order, which exists with
	// a line (were either missing, invoicing would dead-letter it for real,
	// racing the forgery below).
	const handled = 1 << 42
	other := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, customer) OVERRIDING SYSTEM VALUE VALUES ($1, 'real')`, int64(handled)); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO order_lines (order_id, line_no, product_id, sku, name, quantity, unit_price) VALUES ($1, 1, 1, 'S', 'thing', 2, 5)`, int64(handled)); err != nil {
			return nil, err
		}
		return []outbox.Event{orderEvent(handled)}, nil
	})[0]
	subscribertest.WaitFor(t, 30*time.Second, "invoicing's checkpoint of the second order", func() (bool, string) {
		return env.Checkpointed(invoicing.Name, other), ""
	})
	forge(ids[0]+1000, "999999", `{"order_id": 1, "customer": "forged", "lines": 1}`)
	forge(other, "2", `{"order_id": 1, "customer": "forged", "lines": 1}`)
	forge(ids[0], realSeq, `{"order_id": 1, "customer": "forged", "lines": 1}`)
	letters, err = dl.List(ctx, invoicing.Name)
	if err != nil || len(letters) != 4 {
		t.Fatalf("letters: %d (%v)", len(letters), err)
	}
	never, notDead, changed := letters[1], letters[2], letters[3]
	for _, c := range []struct {
		l                operator.Letter
		vouched, intact  bool
		what, refusedFor string
	}{
		{never, false, false, "a letter naming an event that never was", "never recorded it"},
		{notDead, false, false, "a letter naming an event invoicing never dead-lettered", "never recorded it"},
		{changed, true, false, "the real letter with a changed body", ""},
	} {
		if c.l.Vouched != c.vouched || c.l.Intact != c.intact {
			t.Errorf("%s: vouched %t, intact %t; want %t, %t", c.what, c.l.Vouched, c.l.Intact, c.vouched, c.intact)
		}
		ev, source, err := dl.EventOf(ctx, c.l, true)
		switch {
		case c.refusedFor != "" && (err == nil || !strings.Contains(err.Error(), c.refusedFor)):
			t.Errorf("%s, trusting letters: %v; want refused (%s)", c.what, err, c.refusedFor)
		case c.refusedFor == "" && (err != nil || source != operator.SourceOutbox || strings.Contains(string(ev.Payload), "forged")):
			t.Errorf("%s: event from %s (%v), payload %s; want the real event from its outbox row", c.what, source, err, ev.Payload)
		}
	}
	runnerOf := func(string) (*subscribers.Runner, error) {
		return env.NewRunner(invoicing.Subscriber, nil), nil
	}
	done, err := dl.Redrive(ctx, []operator.Letter{never, notDead}, runnerOf, true, "")
	if err != nil || len(done) != 2 || done[0].Err == nil || done[1].Err == nil {
		t.Errorf("redrive of the forged letters: %+v (%v); want both failed", done, err)
	}
	var invoiced int
	if err := env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = 1`).Scan(&invoiced); err != nil || invoiced != 0 {
		t.Errorf("invoices of the forged events: %d (%v)", invoiced, err)
	}
	// The real event was never handled: recording it as handled is
	// refused by the database.
	_, err = env.DB.Pool.Exec(ctx, `SELECT fanout_dead_letter_action('redrive', $1, $2, $3, $4, 'handled', 'lying', $2)`, invoicing.Name, ids[0], int64(real.Seq), realSeq)
	if err == nil || !strings.Contains(err.Error(), "has no checkpoint of it") {
		t.Errorf("a redrive recorded as handled without a checkpoint: %v; want refused", err)
	}
	// Discards: the real letter needs no reason, the forged ones do.
	if n, left, err := dl.Discard(ctx, []operator.Letter{real, never}, ""); err != nil || n != 1 || len(left) != 1 {
		t.Errorf("discard without a reason: %d discarded, left %v (%v); want the real one discarded, the forged one left", n, left, err)
	}
	if n, left, err := dl.Discard(ctx, []operator.Letter{never}, "injected, see ticket 7"); err != nil || n != 1 || len(left) != 0 {
		t.Errorf("discard of the forged letter with a reason: %d, left %v (%v)", n, left, err)
	}
}

func indexOf(st operator.Status, name string) int {
	for i, s := range st.Subscribers {
		if s.Name == name {
			return i
		}
	}
	return -1
}

// A letter of another database's event 1 is not redriven from this
// database's outbox row 1: that row is another event. The event comes from
// the stream's copy, with its own origin.
func TestAnotherDatabasesLetterIsNotReadFromThisOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := subscribertest.NewEnv(t)
	cfg := env.Config
	ids := env.Write(func(tx pgx.Tx) ([]outbox.Event, error) { return []outbox.Event{orderEvent(7)}, nil })
	env.WaitSent(ids...)
	db, err := outbox.ReadDatabase(ctx, env.DB.Pool)
	if err != nil {
		t.Fatal(err)
	}
	another := outbox.Database{System: db.System, Name: "another shop"}
	if _, err := outboxstore.New(env.DB.Pool).AllowOrigin(ctx, another, "its relays share the stream"); err != nil {
		t.Fatal(err)
	}
	other := outbox.Origin{Database: another, Epoch: 1}.String()
	// Another database's order, which this database lacks (as it lacks
	// its own order 7: the test writes events alone): invoicing
	// dead-letters both.
	m := nats.NewMsg(cfg.Stream.SubjectPrefix + "." + shop.OrderCreated)
	m.Data = []byte(`{"order_id": 2199023255552, "customer": "theirs", "lines": 1}`)
	m.Header.Set(wire.EventIDHeader, strconv.FormatInt(ids[0], 10))
	m.Header.Set(wire.OriginHeader, other)
	m.Header.Set(wire.EventTypeHeader, shop.OrderCreated)
	m.Header.Set(wire.AggregateTypeHeader, shop.AggregateOrder)
	m.Header.Set(wire.AggregateIDHeader, "2199023255552")
	if _, err := env.JS.PublishMsg(ctx, m, jetstream.WithMsgID(wire.MsgID(other, ids[0]))); err != nil {
		t.Fatal(err)
	}
	env.StartRunner(invoicing.Subscriber, nil)
	subscribertest.WaitFor(t, 30*time.Second, "both events dead-lettered", func() (bool, string) {
		return len(env.DeadLetters(invoicing.Name)) == 2, fmt.Sprintf("%d letters", len(env.DeadLetters(invoicing.Name)))
	})
	env.WaitIdle(invoicing.Name, 15*time.Second)
	dl, err := operator.OpenDeadLetters(ctx, env.DB.Pool, env.JS, cfg.Stream, cfg.Subscribers)
	if err != nil {
		t.Fatal(err)
	}
	letters, err := dl.List(ctx, invoicing.Name)
	if err != nil || len(letters) != 2 {
		t.Fatalf("letters: %+v (%v)", letters, err)
	}
	theirs := letters[0]
	if theirs.Raw.Header.Get(wire.OriginHeader) != other {
		theirs = letters[1]
	}
	if !theirs.Vouched || theirs.EventID != strconv.FormatInt(ids[0], 10) {
		t.Fatalf("the other database's letter: vouched %t, event %s", theirs.Vouched, theirs.EventID)
	}
	ev, source, err := dl.EventOf(ctx, theirs, false)
	if err != nil {
		t.Fatal(err)
	}
	if source != operator.SourceStream || ev.Origin != other || !strings.Contains(string(ev.Payload), "theirs") {
		t.Fatalf("the letter's event from %s: origin %q, payload %s; want the other database's event from the stream", source, ev.Origin, ev.Payload)
	}
}
