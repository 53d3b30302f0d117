package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fanout events: what a team consuming the events in another language
// reads, from the same declarations the writers and the relay check.
func TestEventsCommands(t *testing.T) {
	t.Parallel()
	out, err := run(t, []string{"FANOUT_STREAM_SUBJECT_PREFIX=shop"}, "events", "list")
	if err != nil {
		t.Fatalf("events list: %v\n%s", err, out)
	}
	for _, want := range []string{
		"order.created          shop.order.created          1        order      fulfilment*,invoicing,salesledger",
		"product.updated        shop.product.updated        1        product    cacheinval,searchindex",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("events list does not say %q:\n%s", want, out)
		}
	}

	out, err = run(t, nil, "events", "schema", "order.paid")
	var schema map[string]any
	if err != nil || json.Unmarshal([]byte(out), &schema) != nil || schema["title"] != "order.paid" {
		t.Errorf("events schema order.paid: %v\n%s", err, out)
	}
	if out, err := run(t, nil, "events", "schema", "order.lost"); err == nil || !strings.Contains(out, `"order.lost" is not declared`) {
		t.Errorf("events schema of an undeclared type: %v\n%s", err, out)
	}

	if out, err := run(t, nil, "events", "check"); err != nil || !strings.Contains(out, "keep every promise") {
		t.Errorf("events check against the built-in release: %v\n%s", err, out)
	}
	// A release that promised a property the declarations no longer have.
	dir := t.TempDir()
	doc, err := os.ReadFile(filepath.Join("..", "..", "shop", "eventtypes", "released", "order.created.json"))
	if err != nil {
		t.Fatal(err)
	}
	doc = []byte(strings.Replace(string(doc), `"properties": {`, `"properties": {"gift": {"type": "boolean"},`, 1))
	if err := os.WriteFile(filepath.Join(dir, "order.created.json"), doc, 0o600); err != nil {
		t.Fatal(err)
	}
	out, err = run(t, nil, "events", "check", "--released", dir)
	if err == nil || !strings.Contains(out, "order.created: /gift: property removed") || !strings.Contains(out, "break the released declarations") {
		t.Errorf("events check against a release with a property since removed: %v\n%s", err, out)
	}
}
