package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers"
)

// fanout outbox numbering sets, shows and clears the event types the
// outbox does not number, and refuses a type an ordered subscriber reads,
// or a list that is not one, before it touches the database.
func TestOutboxNumberingCommand(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_LOG_FORMAT=json"}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	unnumbered := func() []string {
		t.Helper()
		got, err := outboxstore.New(db.Pool).Unnumbered(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}

	if out, err := run(t, env, "outbox", "numbering"); err != nil || !strings.Contains(out, "every event is numbered in its aggregate\n") {
		t.Fatalf("outbox numbering on a new database: %v\n%s", err, out)
	}
	out, err := run(t, env, "outbox", "numbering", "--skip", "product.updated,product.created")
	if err != nil || !strings.Contains(out, "except those of type product.created, product.updated") {
		t.Fatalf("outbox numbering --skip: %v\n%s", err, out)
	}
	if got := unnumbered(); strings.Join(got, ",") != "product.created,product.updated" {
		t.Fatalf("after --skip the outbox skips %q", got)
	}
	for _, refused := range []struct {
		args []string
		want string
	}{
		{[]string{"--skip", "product.updated,order.paid"}, "order.paid (read by fulfilment, an ordered subscriber)"},
		{[]string{"--skip", "product updated"}, "invalid outbox event: event type \"product updated\""},
		{[]string{"--skip", ""}, "--skip needs at least one event type"},
		{[]string{"--skip", "a.b", "--all"}, "give one"},
	} {
		out, err := run(t, env, append([]string{"outbox", "numbering"}, refused.args...)...)
		if err == nil || !strings.Contains(out, refused.want) {
			t.Errorf("outbox numbering %q: %v, want refused saying %q\n%s", refused.args, err, refused.want, out)
		}
	}
	if got := unnumbered(); strings.Join(got, ",") != "product.created,product.updated" {
		t.Fatalf("refused commands changed the list: the outbox skips %q", got)
	}
	if out, err := run(t, env, "outbox", "numbering", "--all"); err != nil || !strings.Contains(out, "every event is numbered in its aggregate\n") {
		t.Fatalf("outbox numbering --all: %v\n%s", err, out)
	}
	if got := unnumbered(); len(got) != 0 {
		t.Fatalf("after --all the outbox skips %q", got)
	}
}

// The refusal matches a type read through a pattern as well as by name,
// and lets through what no ordered subscriber reads.
func TestNumberingRefusesTypesOrderedSubscribersRead(t *testing.T) {
	t.Parallel()
	decls := []subscribers.Declaration{
		{Name: "shipping", EventTypes: []string{"order.>"}, Ordered: true},
		{Name: "audit", EventTypes: []string{"*.deleted", "product.updated"}},
		{Name: "ledger", EventTypes: []string{"invoice.*"}, Ordered: true},
	}
	for _, tc := range []struct {
		skip []string
		want string // in the refusal; "" for none
	}{
		{[]string{"order.refunded"}, "order.refunded (read by shipping, an ordered subscriber, through order.>)"},
		{[]string{"product.updated", "invoice.paid"}, "invoice.paid (read by ledger, an ordered subscriber, through invoice.*)"},
		{[]string{"product.updated", "product.deleted", "invoice.paid.late", "order"}, ""},
	} {
		err := readByOrderedSubscriber(decls, tc.skip)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("skip %q: refused (%v), want allowed: no ordered subscriber reads them", tc.skip, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("skip %q: %v, want refused naming %q", tc.skip, err, tc.want)
		}
	}
}
