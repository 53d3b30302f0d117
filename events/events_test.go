package events_test

import (
	"errors"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/fanout/fanout/events"
)

const orderCreated = `{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "$id": "https://example.test/events/order.created/v1.json",
  "title": "order.created",
  "description": "An order was placed.",
  "x-fanout-aggregate-type": "order",
  "x-fanout-version": 1,
  "type": "object",
  "properties": {
    "order_id": {"type": "integer", "minimum": 1},
    "lines": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}}
  },
  "required": ["order_id"]
}`

func catalog(t *testing.T) *events.Catalog {
	t.Helper()
	c, err := events.Load(fstest.MapFS{"order.created.json": {Data: []byte(orderCreated)}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestCheckNamesThePointerAndTheRule(t *testing.T) {
	c := catalog(t)
	for _, tc := range []struct {
		payload       string
		pointer, rule string
	}{
		{`{"order_id": "7"}`, "/order_id", "type"},
		{`{"order_id": 0}`, "/order_id", "minimum"},
		{`{"lines": []}`, "", "required"},
		{`{"order_id": 7, "lines": [{"sku": "a"}, {"qty": 1}]}`, "/lines/1", "required"},
		{`{"order_id": 7, "lines": [{"sku": 5}]}`, "/lines/0/sku", "type"},
		{`[]`, "", "type"},
		{`{"order_id": 7`, "", "json"},
	} {
		err := c.Check("order.created", []byte(tc.payload))
		var invalid *events.InvalidPayload
		if !errors.As(err, &invalid) {
			t.Errorf("%s: got %v, want an *InvalidPayload", tc.payload, err)
			continue
		}
		if invalid.Pointer != tc.pointer || invalid.Rule != tc.rule || invalid.Type != "order.created" || invalid.Version != 1 {
			t.Errorf("%s: got %+v, want pointer %q and rule %q", tc.payload, invalid, tc.pointer, tc.rule)
		}
		if !strings.Contains(err.Error(), "order.created") || !strings.Contains(err.Error(), tc.rule) {
			t.Errorf("%s: %q names neither the type nor the rule", tc.payload, err)
		}
	}
	for _, ok := range []string{`{"order_id": 7}`, `{"order_id": 7, "lines": [{"sku": "a"}], "added_later": true}`} {
		if err := c.Check("order.created", []byte(ok)); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
}

func TestUndeclaredTypes(t *testing.T) {
	c := catalog(t)
	if err := c.Check("order.paid", []byte(`{}`)); !errors.Is(err, events.ErrUndeclared) {
		t.Errorf("undeclared type: got %v, want ErrUndeclared", err)
	}
	if err := (events.Checker{Types: c}).Check("order.paid", "order", []byte(`{}`)); !errors.Is(err, events.ErrUndeclared) {
		t.Errorf("a checker that does not allow undeclared types: got %v", err)
	}
	allowing := events.Checker{Types: c, AllowUndeclared: true}
	if err := allowing.Check("order.paid", "order", []byte(`{}`)); err != nil {
		t.Errorf("a checker allowing undeclared types: %v", err)
	}
	var invalid *events.InvalidPayload
	if err := allowing.Check("order.created", "order", []byte(`{}`)); !errors.As(err, &invalid) {
		t.Errorf("a checker allowing undeclared types still checks the declared ones: got %v", err)
	}
	if err := (events.Checker{}).Check("anything", "any", []byte(`not json`)); err != nil {
		t.Errorf("a checker with no catalog checks nothing: %v", err)
	}
	if err := allowing.Check("order.created", "basket", []byte(`{"order_id": 1}`)); !errors.Is(err, events.ErrWrongAggregate) || !strings.Contains(err.Error(), "declared for aggregate order, not \"basket\"") {
		t.Errorf("an order.created about a basket: got %v, want ErrWrongAggregate", err)
	}
}

// A declaration that cannot serve is refused at load, naming its file and
// what is wrong.
func TestLoadRefusesBadDeclarations(t *testing.T) {
	edit := func(old, new string) string { return strings.Replace(orderCreated, old, new, 1) }
	for _, tc := range []struct {
		name, file, doc, want string
	}{
		{"no title", "order.created.json", edit(`"title": "order.created",`, ""), `"title"`},
		{"file named otherwise", "order.json", orderCreated, "must be named order.created.json"},
		{"no aggregate", "order.created.json", edit(`"x-fanout-aggregate-type": "order",`, ""), "x-fanout-aggregate-type"},
		{"no version", "order.created.json", edit(`"x-fanout-version": 1,`, ""), "x-fanout-version"},
		{"version zero", "order.created.json", edit(`"x-fanout-version": 1,`, `"x-fanout-version": 0,`), "x-fanout-version"},
		{"no $id", "order.created.json", edit(`"$id": "https://example.test/events/order.created/v1.json",`, ""), `"$id"`},
		{"two-line description", "order.created.json", edit(`"An order was placed."`, `"An order\nwas placed."`), "one line"},
		{"another draft", "order.created.json", edit("draft/2020-12/schema", "draft-07/schema#"), "2020-12"},
		{"not a schema", "order.created.json", edit(`"type": "object"`, `"type": "thing"`), "order.created.json"},
		{"not JSON", "order.created.json", "{", "not JSON"},
	} {
		_, err := events.Load(fstest.MapFS{tc.file: {Data: []byte(tc.doc)}})
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.file) {
			t.Errorf("%s: got %v, want an error naming %s and %q", tc.name, err, tc.file, tc.want)
		}
	}
	if _, err := events.Load(fstest.MapFS{}); err == nil {
		t.Error("no declarations: loaded")
	}
}

func TestTypesAreListedByName(t *testing.T) {
	paid := strings.NewReplacer("order.created", "order.paid", "An order was placed.", "An order was paid.").Replace(orderCreated)
	c, err := events.Load(fstest.MapFS{"order.paid.json": {Data: []byte(paid)}, "order.created.json": {Data: []byte(orderCreated)}})
	if err != nil {
		t.Fatal(err)
	}
	ts := c.Types()
	if len(ts) != 2 || ts[0].Name != "order.created" || ts[1].Name != "order.paid" || ts[1].Description != "An order was paid." || ts[0].AggregateType != "order" {
		t.Errorf("types: %+v", ts)
	}
	if c.Lookup("order.paid") != ts[1] || c.Lookup("order.shipped") != nil {
		t.Error("Lookup does not find what Types lists")
	}
}
