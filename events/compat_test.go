package events_test

import (
	"fmt"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/fanout/fanout/events"
)

// A new declaration of a type is held to what readers of the released one
// were promised: adding an optional property passes; removing, retyping,
// requiring, closing or re-ruling one is reported, at any depth.
func TestBreaksOfANewVersion(t *testing.T) {
	released := load(t, orderCreated)
	// v2 is orderCreated as a new version, with edit applied.
	v2 := func(old, new string) *events.Type {
		doc := strings.NewReplacer(`"x-fanout-version": 1`, `"x-fanout-version": 2`, "/v1.json", "/v2.json", old, new).Replace(orderCreated)
		return load(t, doc)
	}
	for _, tc := range []struct {
		name string
		next *events.Type
		want string // "" means compatible
	}{
		{"unchanged", released, ""},
		{"reworded", load(t, strings.Replace(orderCreated, "An order was placed.", "A customer placed an order.", 1)), ""},
		{"an optional property added", v2(`"order_id": {"type": "integer", "minimum": 1},`, `"order_id": {"type": "integer", "minimum": 1}, "note": {"type": "string"},`), ""},
		{"a property removed", v2(`"order_id": {"type": "integer", "minimum": 1},`, ``), "/order_id: property removed"},
		{"a property retyped", v2(`"order_id": {"type": "integer", "minimum": 1}`, `"order_id": {"type": "string"}`), "/order_id: its rules changed"},
		{"a nested property retyped", v2(`"sku": {"type": "string"}`, `"sku": {"type": "integer"}`), "/lines/*/sku: its rules changed"},
		{"a rule narrowed", v2(`"minimum": 1`, `"minimum": 10`), "/order_id: its rules changed"},
		{"a property made required", v2(`"required": ["order_id"]`, `"required": ["order_id", "lines"]`), `property "lines" is required now`},
		{"properties closed", v2(`"type": "object",`, `"type": "object", "additionalProperties": false,`), "additionalProperties"},
		{"the aggregate changed", v2(`"x-fanout-aggregate-type": "order"`, `"x-fanout-aggregate-type": "basket"`), "aggregate type changed"},
		{"a property no longer required", v2(`"required": ["order_id"]`, `"required": []`), `property "order_id" is no longer required`},
		{"a format and an x- keyword added", v2(`"order_id": {"type": "integer", "minimum": 1}`, `"order_id": {"type": "integer", "minimum": 1, "format": "int64", "x-note": "ours"}`), ""},
		{"a change without a new version", load(t, strings.Replace(orderCreated, `"order_id": {"type": "integer", "minimum": 1},`, `"order_id": {"type": "integer", "minimum": 1}, "note": {"type": "string"},`, 1)), "version did not go up"},
	} {
		got := strings.Join(events.Breaks(released, tc.next), "; ")
		if tc.want == "" && got != "" {
			t.Errorf("%s: reported %q, want compatible", tc.name, got)
		}
		if tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%s: reported %q, want %q", tc.name, got, tc.want)
		}
	}
}

// Schemas of other shapes: closed ones, additionalProperties a schema,
// enums.
func TestBreaksOfOtherShapes(t *testing.T) {
	doc := func(version int, props, extra string) *events.Type {
		return load(t, fmt.Sprintf(`{"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.test/order.created/v%d.json",
  "title": "order.created", "description": "An order was placed.", "x-fanout-aggregate-type": "order", "x-fanout-version": %d,
  "type": "object", "properties": {%s}%s}`, version, version, props, extra))
	}
	for _, tc := range []struct {
		name           string
		released, next *events.Type
		want           string
	}{
		{"a property added to a closed schema", doc(1, `"a": {"type": "string"}`, `, "additionalProperties": false`),
			doc(2, `"a": {"type": "string"}, "b": {"type": "string"}`, `, "additionalProperties": false`), "/b: property added where the released schema refuses"},
		{"additionalProperties retyped", doc(1, `"a": {"type": "string"}`, `, "additionalProperties": {"type": "string"}`),
			doc(2, `"a": {"type": "string"}`, `, "additionalProperties": {"type": "integer"}`), "additionalProperties changed"},
		{"an enum reordered", doc(1, `"s": {"enum": ["a", "b", 3]}`, ""), doc(1, `"s": {"enum": [3, "b", "a"]}`, ""), ""},
		{"an enum narrowed", doc(1, `"s": {"enum": ["a", "b"]}`, ""), doc(2, `"s": {"enum": ["a"]}`, ""), "/s: its rules changed"},
	} {
		got := strings.Join(events.Breaks(tc.released, tc.next), "; ")
		if tc.want == "" && got != "" || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%s: reported %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestBreaksOfARelease(t *testing.T) {
	released, err := events.Load(fstest.MapFS{"order.created.json": {Data: []byte(orderCreated)}})
	if err != nil {
		t.Fatal(err)
	}
	paid := strings.NewReplacer("order.created", "order.paid").Replace(orderCreated)
	onlyPaid, err := events.Load(fstest.MapFS{"order.paid.json": {Data: []byte(paid)}})
	if err != nil {
		t.Fatal(err)
	}
	if got := events.BreaksRelease(released, onlyPaid); len(got) != 1 || !strings.Contains(got[0], "order.created: no longer declared") {
		t.Errorf("a type dropped: %q", got)
	}
	if got := events.BreaksRelease(onlyPaid, mustLoadBoth(t, paid)); got != nil {
		t.Errorf("a type added: %q, want compatible", got)
	}
}

func mustLoadBoth(t *testing.T, paid string) *events.Catalog {
	c, err := events.Load(fstest.MapFS{"order.created.json": {Data: []byte(orderCreated)}, "order.paid.json": {Data: []byte(paid)}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// load compiles one declaration of order.created.
func load(t *testing.T, doc string) *events.Type {
	t.Helper()
	c, err := events.Load(fstest.MapFS{"order.created.json": {Data: []byte(doc)}})
	if err != nil {
		t.Fatalf("%v\n%s", err, doc)
	}
	return c.Lookup("order.created")
}
