package events

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// fastTypes are declarations to hold the fast path to: the shop's, and one
// with every keyword the fast path reads.
func fastTypes(t testing.TB) []*Type {
	t.Helper()
	c, err := Load(os.DirFS(filepath.Join("..", "shop", "eventtypes")))
	if err != nil {
		t.Fatal(err)
	}
	every, err := Load(mapFS("all.kinds", `{
  "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.test/all.kinds/v1.json",
  "title": "all.kinds", "description": "Every keyword the fast path reads.", "x-fanout-aggregate-type": "thing", "x-fanout-version": 1,
  "type": "object", "additionalProperties": false, "required": ["id", "kind"],
  "properties": {
    "id": {"type": "integer", "minimum": -5, "exclusiveMaximum": 100},
    "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "kind": {"enum": ["a", "b", 3, true, null]},
    "tag": {"type": ["string", "null"], "minLength": 2, "maxLength": 4},
    "fixed": {"const": "x"},
    "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "any": {},
    "nested": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
  }
}`))
	if err != nil {
		t.Fatal(err)
	}
	types := append(c.Types(), every.Types()...)
	for _, ty := range types {
		if ty.fast == nil {
			t.Fatalf("%s has no fast path: the shop's declarations should all have one", ty.Name)
		}
	}
	return types
}

// The fast path never passes a payload the general validator refuses
// (random payloads shaped like each declaration's, with the values that
// trip validators: escapes, 1.0, 1e2, leading zeros, big numbers,
// duplicate keys, broken JSON), and on plain payloads (whole numbers,
// strings without escapes, each key once) it gives the validator's verdict
// exactly, or it would be no faster.
func TestFastPathAgreesWithTheValidator(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	plainValid := 0
	for _, ty := range fastTypes(t) {
		for i := range 6000 {
			plain := i%2 == 0
			payload := randomPayload(rng, ty, plain)
			fast := ty.fast.validJSON(payload)
			v, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
			valid := err == nil && ty.compiled.Validate(v) == nil
			if fast && !valid {
				t.Fatalf("%s: the fast path passed %s, which the validator refuses (%v)", ty.Name, payload, ty.Check(payload))
			}
			if plain && fast != valid {
				t.Fatalf("%s: the fast path refused the plain payload %s, which the validator passes", ty.Name, payload)
			}
			if plain && valid {
				plainValid++
			}
		}
	}
	if plainValid < 3000 {
		t.Errorf("only %d plain payloads were valid: the test does not reach the fast path's passes", plainValid)
	}
}

func FuzzFastPath(f *testing.F) {
	types := fastTypes(f)
	for _, seed := range []string{`{"product_id": 1}`, `{"order_id":7,"from":"created","to":"paid","n":2}`, `{"id": 01, "kind": "a"}`,
		`{"id": 1, "kind": "\u0061"}`, `{"id": 1.0, "kind": 3}`, `{"id": 1, "kind": null, "nested": {"n": 3}}`, `{"id":1,"kind":"a","id":"x"}`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		for _, ty := range types {
			if !ty.fast.validJSON(payload) {
				continue
			}
			v, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
			if err != nil || ty.compiled.Validate(v) != nil {
				t.Fatalf("%s: the fast path passed %q, which the validator refuses", ty.Name, payload)
			}
		}
	})
}

func propertyNames(ty *Type) []string {
	var names []string
	for name := range ty.fast.props {
		names = append(names, name)
	}
	return append(names, "other")
}

// Values a property may get: plain ones, then the others.
var (
	plainValues = []string{
		`0`, `1`, `2`, `3`, `-1`, `-5`, `-6`, `99`, `100`, `-0`, `9223372036854775807`, `-9223372036854775808`,
		`"a"`, `"b"`, `"x"`, `"ab"`, `"abcd"`, `"abcde"`, `"é"`, `"éé"`, `"created"`, `"paid"`, `"shipped"`, `"😀😀"`, `""`,
		`true`, `false`, `null`, `[]`, `[true]`, `[true, false, true, false]`, `[1]`, `{}`, `{"n": 3}`, `{"n": 4}`, `{"n": "3"}`, `{"m": 1}`,
	}
	oddValues = []string{
		`01`, `1.0`, `1.5`, `0.5`, `1e2`, `1E0`, `2e-1`, `9223372036854775808`, `-9223372036854775809`, `+1`, `-`,
		`"\u0061"`, `"a\"b"`, `"\ud83d\ude00\ud83d\ude00"`, `"\x"`, `tru`, `nul`, `[1,]`, `{"n": 3,}`,
	}
	randomValues = append(append([]string{}, plainValues...), oddValues...)
)

// randomPayload is an object of some of ty's properties (and one it does
// not name) with random values; plain: each key once, plain values only,
// most of them ones the property's own fast schema passes (so that whole
// payloads often pass, and a fast path too lax shows); else now and then
// broken or not an object at all.
func randomPayload(rng *rand.Rand, ty *Type, plain bool) []byte {
	names := propertyNames(ty)
	values := randomValues
	if plain {
		values = plainValues
	}
	var b strings.Builder
	ws := func() {
		if rng.IntN(4) == 0 {
			b.WriteString([]string{" ", "\n", "\t ", "\r\n"}[rng.IntN(4)])
		}
	}
	if rng.IntN(20) == 0 {
		return []byte(values[rng.IntN(len(values))])
	}
	ws()
	b.WriteString("{")
	keys := slices.Clone(names)
	rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
	n := rng.IntN(len(names) + 1)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		ws()
		key := keys[i]
		if !plain {
			key = names[rng.IntN(len(names))]
		}
		fmt.Fprintf(&b, "%q", key)
		ws()
		b.WriteString(":")
		ws()
		value := values[rng.IntN(len(values))]
		if p := ty.fast.props[key]; plain && p != nil && rng.IntN(10) < 8 {
			var pool []string
			for _, v := range plainValues {
				if p.validJSON([]byte(v)) {
					pool = append(pool, v)
				}
			}
			if len(pool) > 0 {
				value = pool[rng.IntN(len(pool))]
			}
		}
		b.WriteString(value)
		ws()
	}
	b.WriteString("}")
	ws()
	out := b.String()
	if !plain && rng.IntN(30) == 0 && len(out) > 2 {
		cut := rng.IntN(len(out))
		out = out[:cut] + out[cut+1:] // broken JSON, most likely
	}
	return []byte(out)
}

func mapFS(name, doc string) fstest.MapFS {
	return fstest.MapFS{name + ".json": {Data: []byte(doc)}}
}

// What the fast path cannot decide the same way as the validator it does
// not try: a schema with both const and enum, a nested schema of another
// draft, text nested deeper than maxDepth, a key not UTF-8.
func TestFastPathLeavesWhatItCannotReadToTheValidator(t *testing.T) {
	decl := func(props string) *Type {
		c, err := Load(mapFS("x.made", `{"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.test/x.made/v1.json",
  "title": "x.made", "description": "A thing.", "x-fanout-aggregate-type": "x", "x-fanout-version": 1,
  "type": "object", "properties": `+props+`}`))
		if err != nil {
			t.Fatal(err)
		}
		return c.Lookup("x.made")
	}
	if ty := decl(`{"k": {"const": "a", "enum": ["a", "b"]}}`); ty.fast != nil {
		t.Error("a schema with both const and enum has a fast path")
	}
	if ty := decl(`{"e": {"$id": "https://example.test/e.json", "$schema": "http://json-schema.org/draft-07/schema#", "type": "string", "format": "email"}}`); ty.fast != nil {
		t.Error("a nested schema of draft-07 has a fast path")
	}
	ty := decl(`{"n": {"type": "integer"}}`)
	deep := `{"n": 1, "x": ` + strings.Repeat("[", maxDepth+1) + strings.Repeat("]", maxDepth+1) + `}`
	if ty.fast.validJSON([]byte(deep)) {
		t.Errorf("text nested %d deep passed the fast path", maxDepth+1)
	}
	if !ty.fast.validJSON([]byte(`{"n": 1, "x": ` + strings.Repeat("[", maxDepth-1) + strings.Repeat("]", maxDepth-1) + `}`)) {
		t.Error("text nested within maxDepth did not pass the fast path")
	}
	if ty.fast.validJSON([]byte("{\"n\": 1, \"a\xff\": 2}")) {
		t.Error("a key that is not UTF-8 passed the fast path")
	}
}
