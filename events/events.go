// Package events holds the declared event types: for each type a writer
// may commit, its aggregate type, a version, a one-line description and
// the JSON Schema (draft 2020-12) its payload must match. A declaration is
// a JSON Schema document of its own, readable by any language:
//
//	{
//	  "$schema": "https://json-schema.org/draft/2020-12/schema",
//	  "$id": "https://fanout.dev/events/order.created/v1.json",
//	  "title": "order.created",
//	  "description": "An order was placed.",
//	  "x-fanout-aggregate-type": "order",
//	  "x-fanout-version": 1,
//	  "type": "object", ...
//	}
//
// A Catalog is the declarations of one domain, compiled once. The writers
// check a payload before it is written (outbox.CheckedAgainst) and the
// relay checks the rows written some other way, marking a row that breaks
// its schema failed with the Catalog's reason.
package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

// Type is one declared event type.
type Type struct {
	// Name is the event type, as in outbox.Event.Type ("order.created").
	Name string
	// AggregateType is the aggregate its events are about ("order").
	AggregateType string
	// Version is the schema's version. A change that is not compatible
	// (a property removed or retyped, or made required) needs a new type.
	Version int
	// Description is one line on what happened.
	Description string
	// ID is the schema's $id, which names this version of it.
	ID string
	// Schema is the declaration as written.
	Schema json.RawMessage

	compiled *jsonschema.Schema
	// fast, when the schema allows it, passes the common payload without
	// the general validator's cost (fast.go).
	fast *fastSchema
}

// Catalog is a set of declared event types, compiled once; safe for
// concurrent use.
type Catalog struct {
	types map[string]*Type
}

// ErrUndeclared is returned by Check for an event type the catalog does
// not declare.
var ErrUndeclared = errors.New("event type not declared")

// InvalidPayload says where a payload breaks its type's schema and which
// rule it breaks.
type InvalidPayload struct {
	Type    string
	Version int
	// Pointer is the JSON pointer of the offending value ("" is the whole
	// payload).
	Pointer string
	// Rule is the schema keyword broken ("type", "required", ...) and
	// Detail what the validator said of it.
	Rule, Detail string
}

func (e *InvalidPayload) Error() string {
	at := e.Pointer
	if at == "" {
		at = "the payload"
	}
	return fmt.Sprintf("payload of %s does not match its schema (version %d): at %s, rule %q: %s", e.Type, e.Version, at, e.Rule, e.Detail)
}

// The declaration's keywords of its own, besides JSON Schema's.
const (
	aggregateKeyword = "x-fanout-aggregate-type"
	versionKeyword   = "x-fanout-version"
)

// Load reads every *.json file at the root of fsys as one declaration and
// compiles them. A declaration that cannot be read, names no type or
// aggregate, or is not a valid JSON Schema is an error naming its file.
func Load(fsys fs.FS) (*Catalog, error) {
	files, err := fs.Glob(fsys, "*.json")
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, errors.New("events: no declarations (*.json) to load")
	}
	c := &Catalog{types: make(map[string]*Type, len(files))}
	for _, file := range files {
		t, err := load(fsys, file)
		if err != nil {
			return nil, fmt.Errorf("events: %s: %w", file, err)
		}
		if other, ok := c.types[t.Name]; ok {
			return nil, fmt.Errorf("events: %s declares %s, already declared by %s", file, t.Name, other.ID)
		}
		c.types[t.Name] = t
	}
	return c, nil
}

// MustLoad is Load for declarations built into the binary, whose test
// proves they load.
func MustLoad(fsys fs.FS) *Catalog {
	c, err := Load(fsys)
	if err != nil {
		panic(err)
	}
	return c
}

func load(fsys fs.FS, file string) (*Type, error) {
	raw, err := fs.ReadFile(fsys, file)
	if err != nil {
		return nil, err
	}
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	obj, ok := doc.(map[string]any)
	if !ok {
		return nil, errors.New("a declaration is a JSON object")
	}
	t := &Type{Schema: raw}
	t.Name, _ = obj["title"].(string)
	t.Description, _ = obj["description"].(string)
	t.AggregateType, _ = obj[aggregateKeyword].(string)
	t.ID, _ = obj["$id"].(string)
	if v, ok := obj[versionKeyword].(json.Number); ok {
		n, err := v.Int64()
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s must be a whole number from 1, not %s", versionKeyword, v)
		}
		t.Version = int(n)
	}
	switch {
	case t.Name == "":
		return nil, errors.New(`"title" must name the event type`)
	case strings.TrimSuffix(path.Base(file), ".json") != t.Name:
		return nil, fmt.Errorf("declares %s: the file must be named %s.json", t.Name, t.Name)
	case t.AggregateType == "":
		return nil, fmt.Errorf("%q must name the aggregate type", aggregateKeyword)
	case t.Version == 0:
		return nil, fmt.Errorf("%q must give the schema's version", versionKeyword)
	case t.ID == "":
		return nil, errors.New(`"$id" must name this version of the schema`)
	case t.Description == "" || strings.Contains(t.Description, "\n"):
		return nil, errors.New(`"description" must be one line`)
	}
	if s, _ := obj["$schema"].(string); s != "https://json-schema.org/draft/2020-12/schema" {
		return nil, fmt.Errorf(`"$schema" must be https://json-schema.org/draft/2020-12/schema, not %q`, s)
	}
	compiler := jsonschema.NewCompiler()
	if err := compiler.AddResource(t.ID, doc); err != nil {
		return nil, err
	}
	if t.compiled, err = compiler.Compile(t.ID); err != nil {
		return nil, err
	}
	t.fast, _ = compileFast(doc)
	return t, nil
}

// Check returns nil if payload matches the schema of its type, an
// *InvalidPayload if it does not (or is not JSON), and an error wrapping
// ErrUndeclared if the catalog does not declare the type. A nil Catalog
// declares nothing.
func (c *Catalog) Check(eventType string, payload []byte) error {
	t := c.Lookup(eventType)
	if t == nil {
		return fmt.Errorf("%w: %s", ErrUndeclared, eventType)
	}
	return t.Check(payload)
}

// Check returns nil if payload matches the type's schema, or an
// *InvalidPayload.
func (t *Type) Check(payload []byte) error {
	if t.fast != nil && t.fast.validJSON(payload) {
		return nil
	}
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		return &InvalidPayload{Type: t.Name, Version: t.Version, Rule: "json", Detail: err.Error()}
	}
	err = t.compiled.Validate(v)
	if err == nil {
		return nil
	}
	var ve *jsonschema.ValidationError
	if !errors.As(err, &ve) {
		return &InvalidPayload{Type: t.Name, Version: t.Version, Rule: "schema", Detail: err.Error()}
	}
	return t.invalid(ve)
}

var english = message.NewPrinter(language.English)

// invalid names the first leaf of the validator's error: the deepest
// cause is the rule actually broken ("type" at /price_cents), not the
// schema's root that contains it.
func (t *Type) invalid(ve *jsonschema.ValidationError) *InvalidPayload {
	for len(ve.Causes) > 0 {
		ve = ve.Causes[0]
	}
	p := &InvalidPayload{Type: t.Name, Version: t.Version, Detail: ve.ErrorKind.LocalizedString(english)}
	for _, tok := range ve.InstanceLocation {
		p.Pointer += "/" + strings.NewReplacer("~", "~0", "/", "~1").Replace(tok)
	}
	if kw := ve.ErrorKind.KeywordPath(); len(kw) > 0 {
		p.Rule = kw[len(kw)-1]
	}
	return p
}

// Lookup returns the declaration of eventType, or nil.
func (c *Catalog) Lookup(eventType string) *Type {
	if c == nil {
		return nil
	}
	return c.types[eventType]
}

// Types returns every declared type, by name.
func (c *Catalog) Types() []*Type {
	if c == nil {
		return nil
	}
	ts := make([]*Type, 0, len(c.types))
	for _, t := range c.types {
		ts = append(ts, t)
	}
	slices.SortFunc(ts, func(a, b *Type) int { return strings.Compare(a.Name, b.Name) })
	return ts
}

// Checker applies a Catalog, with a rule for the types it does not
// declare. Its zero value checks nothing.
type Checker struct {
	Types *Catalog
	// AllowUndeclared lets through a type Types does not declare; without
	// it such a type is refused with ErrUndeclared.
	AllowUndeclared bool
}

// ErrWrongAggregate is returned by Checker.Check for an event of a
// declared type about another aggregate type than its declaration's.
var ErrWrongAggregate = errors.New("event about another aggregate type than its declaration's")

// Check returns nil when there is no catalog, the event is about the
// aggregate type its declaration names and its payload matches the
// schema, or the type is undeclared and allowed; otherwise an error
// wrapping ErrWrongAggregate, or Catalog.Check's.
func (k Checker) Check(eventType, aggregateType string, payload []byte) error {
	if k.Types == nil {
		return nil
	}
	t := k.Types.Lookup(eventType)
	switch {
	case t == nil && k.AllowUndeclared:
		return nil
	case t == nil:
		return fmt.Errorf("%w: %s", ErrUndeclared, eventType)
	case t.AggregateType != aggregateType:
		return fmt.Errorf("%w: %s is declared for aggregate %s, not %q", ErrWrongAggregate, eventType, t.AggregateType, aggregateType)
	}
	return t.Check(payload)
}
