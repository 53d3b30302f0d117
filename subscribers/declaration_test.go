package subscribers_test

import (
	"strings"
	"testing"

	"github.com/fanout/fanout/subscribers"
)

// tallyDecl declares a backfilled subscriber (its handler does not matter
// here: the backfill package runs it).
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
