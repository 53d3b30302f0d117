package subscribers_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
)

// tallyDecl declares a backfilled subscriber (its constructor makes no
// handler: the backfill package runs one).
var tallyDecl = subscribers.Declaration{
	Name: "tally", EventTypes: []string{"thing.created"},
	Backfill: &subscribers.Backfill{Table: "backfill_source", Key: "id", EventType: "thing.created", AggregateType: "thing",
		Payload: "jsonb_build_object('id', t.id, 'kind', t.kind)"},
	New: func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Handler{}, nil },
}

func TestBackfillDeclarationIsValidated(t *testing.T) {
	d := tallyDecl
	bf := *d.Backfill
	bf.EventType = "other.created"
	bf.Table = "Robert'); DROP TABLE students;--"
	d.Backfill = &bf
	err := d.Validate()
	if err == nil || !strings.Contains(err.Error(), `backfill event type "other.created"`) || !strings.Contains(err.Error(), "backfill table") {
		t.Fatalf("Validate: %v", err)
	}
	d = tallyDecl
	d.Ordered = true
	if err := d.Validate(); err == nil || !strings.Contains(err.Error(), "ordered") {
		t.Fatalf("Validate of an ordered backfill: %v", err)
	}
	if g := tallyDecl.AllGrants(); len(g) != 1 || g[0] != "SELECT ON backfill_source" {
		t.Fatalf("AllGrants: %v", g)
	}
}

type noop struct{}

func (noop) Handle(context.Context, subscribers.Event) error           { return nil }
func (noop) HandleTx(context.Context, pgx.Tx, subscribers.Event) error { return nil }

// The declaration says, once, what a subscriber is called, which events it
// takes and whether it takes them in order; its handler says only how it
// handles one. An ordered subscriber's handler is made by Tx (its
// per-aggregate checkpoint commits with its effects): Build and New
// refuse another kind, and a constructor that makes none.
func TestTheDeclarationRunsItsKindOfHandler(t *testing.T) {
	ordered := subscribers.Declaration{Name: "ordered", EventTypes: []string{"order.>"}, Ordered: true,
		New: func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Each(noop{}), nil }}
	if _, err := ordered.Build(subscribers.Deps{}); err == nil || !strings.Contains(err.Error(), "subscribers.Tx") {
		t.Errorf("Build of an ordered subscriber with an Each handler: %v", err)
	}
	_, err := subscribers.New(subscribers.Options{Declaration: ordered, Handler: subscribers.Each(noop{}), Logger: slog.Default()})
	if err == nil || !strings.Contains(err.Error(), "subscribers.Tx") {
		t.Errorf("New of an ordered subscriber with an Each handler: %v", err)
	}
	ordered.New = func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Tx(noop{}), nil }
	if _, err := ordered.Build(subscribers.Deps{}); err != nil {
		t.Errorf("Build of an ordered subscriber with a Tx handler: %v", err)
	}
	if _, err := tallyDecl.Build(subscribers.Deps{}); err == nil || !strings.Contains(err.Error(), "no handler") {
		t.Errorf("Build of a constructor that makes no handler: %v", err)
	}
}
