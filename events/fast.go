package events

// A fast path for the schemas event declarations usually are: objects of
// typed properties, with required ones, bounds, lengths, const and enum.
//
// The general validator costs about 9 µs and 57 allocations a payload,
// which doubled the relay's CPU a row (docs/benchmarks.md). A schema that
// uses only the keywords below is compiled again into a fastSchema, which
// says whether a decoded payload passes with no allocation. It decides
// only the common case: a payload it passes is valid; one it fails goes to
// the general validator, which has the last word and names the pointer
// and the rule. TestFastPathAgreesWithTheValidator holds the two to the
// same verdicts.

import (
	"bytes"
	"encoding/json"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Value kinds, as bits of fastSchema.types.
const (
	kindNull uint8 = 1 << iota
	kindBoolean
	kindObject
	kindArray
	kindNumber
	kindInteger
	kindString
)

var kindNames = map[string]uint8{
	"null": kindNull, "boolean": kindBoolean, "object": kindObject, "array": kindArray,
	"number": kindNumber, "integer": kindInteger, "string": kindString,
}

type fastSchema struct {
	types    uint8 // 0: any type
	props    map[string]*fastSchema
	required []string
	closed   bool // additionalProperties false
	items    *fastSchema
	// enum holds the allowed values (const is an enum of one); hasEnum
	// tells an enum apart from none.
	enum    []any
	hasEnum bool
	// Numeric bounds, nil when absent; intBounds: each a whole number an
	// int64 holds, so that a payload's integer is compared without big.Rat.
	min, max, exMin, exMax *big.Rat
	intBounds              bool
	// Length bounds of strings (in code points) and arrays, -1 when absent.
	minLen, maxLen, minItems, maxItems int
}

// annotationKeywords say nothing of which values pass ("format" is an
// annotation too: the general validator is not told to assert it in
// draft 2020-12).
var annotationKeywords = []string{"$comment", "title", "description", "examples", "default", "deprecated", "format",
	aggregateKeyword, versionKeyword}

// compileFast compiles a schema decoded by jsonschema.UnmarshalJSON, or
// says it uses a keyword the fast path does not know. $schema and $id are
// read at the root only: a nested one may name another draft, with other
// rules (an older draft asserts format).
func compileFast(v any) (*fastSchema, bool) { return compileFastAt(v, true) }

func compileFastAt(v any, root bool) (*fastSchema, bool) {
	m, ok := v.(map[string]any)
	if !ok {
		return nil, false // a boolean schema: rare, left to the general validator
	}
	_, hasConst := m["const"]
	_, hasEnum := m["enum"]
	if hasConst && hasEnum {
		return nil, false // both must hold: left to the general validator
	}
	s := &fastSchema{minLen: -1, maxLen: -1, minItems: -1, maxItems: -1}
	for k, x := range m {
		switch {
		case root && (k == "$schema" || k == "$id"):
		case slices.Contains(annotationKeywords, k), strings.HasPrefix(k, "x-"):
		case k == "type":
			if !s.compileType(x) {
				return nil, false
			}
		case k == "properties":
			props, ok := x.(map[string]any)
			if !ok {
				return nil, false
			}
			s.props = make(map[string]*fastSchema, len(props))
			for name, p := range props {
				if s.props[name], ok = compileFastAt(p, false); !ok {
					return nil, false
				}
			}
		case k == "required":
			list, ok := x.([]any)
			if !ok {
				return nil, false
			}
			for _, r := range list {
				name, ok := r.(string)
				if !ok {
					return nil, false
				}
				s.required = append(s.required, name)
			}
		case k == "additionalProperties":
			b, ok := x.(bool)
			if !ok {
				return nil, false
			}
			s.closed = !b
		case k == "items":
			if s.items, ok = compileFastAt(x, false); !ok {
				return nil, false
			}
		case k == "const":
			if !enumerable(x) {
				return nil, false
			}
			s.enum, s.hasEnum = []any{x}, true
		case k == "enum":
			list, ok := x.([]any)
			if !ok || !all(list, enumerable) {
				return nil, false
			}
			s.enum, s.hasEnum = list, true
		case k == "minimum" || k == "maximum" || k == "exclusiveMinimum" || k == "exclusiveMaximum":
			r, ok := rat(x)
			if !ok {
				return nil, false
			}
			*map[string]**big.Rat{"minimum": &s.min, "maximum": &s.max, "exclusiveMinimum": &s.exMin, "exclusiveMaximum": &s.exMax}[k] = r
		case k == "minLength" || k == "maxLength" || k == "minItems" || k == "maxItems":
			r, ok := rat(x)
			if !ok || !r.IsInt() || r.Sign() < 0 || !r.Num().IsInt64() {
				return nil, false
			}
			*map[string]*int{"minLength": &s.minLen, "maxLength": &s.maxLen, "minItems": &s.minItems, "maxItems": &s.maxItems}[k] = int(r.Num().Int64())
		default:
			return nil, false
		}
	}
	s.intBounds = intBound(s.min) && intBound(s.max) && intBound(s.exMin) && intBound(s.exMax)
	return s, true
}

func all(list []any, f func(any) bool) bool {
	for _, x := range list {
		if !f(x) {
			return false
		}
	}
	return true
}

// intBound: absent, or a whole number an int64 holds.
func intBound(r *big.Rat) bool { return r == nil || r.IsInt() && r.Num().IsInt64() }

func (s *fastSchema) compileType(x any) bool {
	names := []any{x}
	if list, ok := x.([]any); ok {
		names = list
	}
	for _, n := range names {
		name, _ := n.(string)
		bit, ok := kindNames[name]
		if !ok {
			return false
		}
		s.types |= bit
	}
	return true
}

// enumerable: a const or enum value the fast path compares (objects and
// arrays are left to the general validator).
func enumerable(v any) bool {
	switch v.(type) {
	case nil, bool, string, json.Number:
		return true
	}
	return false
}

// rat reads a JSON number exactly.
func rat(v any) (*big.Rat, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return nil, false
	}
	return new(big.Rat).SetString(string(n))
}

// validJSON says whether the JSON text data passes, reading it in place:
// no decoding, no allocation. Only a true is trusted: whatever it does not
// read plainly (an escape in a string it must compare, a number it cannot
// hold in an int64, broken JSON) makes it say false, and the general
// validator decides.
func (s *fastSchema) validJSON(data []byte) bool {
	r := reader{data: data}
	if !s.validValue(&r) {
		return false
	}
	r.space()
	return r.at == len(r.data)
}

// reader walks a JSON text.
type reader struct {
	data  []byte
	at    int
	depth int // objects and arrays open
}

// maxDepth: deeper text is left to the general validator (whose decoder
// refuses JSON nested over 10,000 deep), and the walk's recursion stays
// bounded.
const maxDepth = 1000

func (r *reader) space() {
	for r.at < len(r.data) {
		switch r.data[r.at] {
		case ' ', '\t', '\n', '\r':
			r.at++
		default:
			return
		}
	}
}

// peek is the next byte after white space, or 0 at the end.
func (r *reader) peek() byte {
	r.space()
	if r.at < len(r.data) {
		return r.data[r.at]
	}
	return 0
}

// str reads a string token and returns its content; escaped says it
// holds an escape, so the content is not the value.
func (r *reader) str() (content []byte, escaped, ok bool) {
	if r.peek() != '"' {
		return nil, false, false
	}
	r.at++
	start := r.at
	for r.at < len(r.data) {
		switch c := r.data[r.at]; {
		case c == '"':
			r.at++
			return r.data[start : r.at-1], escaped, true
		case c == '\\':
			escaped = true
			if r.at+1 >= len(r.data) {
				return nil, false, false
			}
			switch r.data[r.at+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				r.at += 2
			case 'u':
				if r.at+6 > len(r.data) || !isHex(r.data[r.at+2:r.at+6]) {
					return nil, false, false
				}
				r.at += 6
			default:
				return nil, false, false
			}
		case c < 0x20:
			return nil, false, false
		default:
			r.at++
		}
	}
	return nil, false, false
}

func isHex(b []byte) bool {
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// number reads a number token.
func (r *reader) number() ([]byte, bool) {
	r.space()
	start := r.at
	for r.at < len(r.data) {
		c := r.data[r.at]
		if c >= '0' && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E' {
			r.at++
			continue
		}
		break
	}
	return r.data[start:r.at], r.at > start
}

// literal reads true, false or null.
func (r *reader) literal(word string) bool {
	r.space()
	if len(r.data)-r.at >= len(word) && string(r.data[r.at:r.at+len(word)]) == word {
		r.at += len(word)
		return true
	}
	return false
}

func (s *fastSchema) validValue(r *reader) bool {
	switch c := r.peek(); {
	case (c == '{' || c == '[') && r.depth >= maxDepth:
		return false
	case c == '{':
		return s.allows(kindObject) && !s.hasEnum && s.validObject(r)
	case c == '[':
		return s.allows(kindArray) && !s.hasEnum && s.validArray(r)
	case c == '"':
		content, escaped, ok := r.str()
		if !ok || !s.allows(kindString) {
			return false
		}
		if (escaped || !utf8.Valid(content)) && (s.hasEnum || s.minLen >= 0 || s.maxLen >= 0) {
			return false
		}
		if s.minLen >= 0 || s.maxLen >= 0 {
			n := utf8.RuneCount(content)
			if s.minLen >= 0 && n < s.minLen || s.maxLen >= 0 && n > s.maxLen {
				return false
			}
		}
		return !s.hasEnum || slices.ContainsFunc(s.enum, func(e any) bool { es, ok := e.(string); return ok && es == string(content) })
	case c == 't' || c == 'f':
		b := c == 't'
		if !r.literal(map[bool]string{true: "true", false: "false"}[b]) || !s.allows(kindBoolean) {
			return false
		}
		return !s.hasEnum || slices.Contains(s.enum, any(b))
	case c == 'n':
		return r.literal("null") && s.allows(kindNull) && (!s.hasEnum || slices.Contains(s.enum, nil))
	default:
		tok, ok := r.number()
		if !ok {
			return false
		}
		// Only whole numbers an int64 holds, written plainly, are read
		// here: anything else (1.5, 1e2, 1.0, a bigger one, 01) goes to
		// the general validator.
		if !plainInteger(tok) {
			return false
		}
		i, err := strconv.ParseInt(string(tok), 10, 64)
		if err != nil || !s.allows(kindInteger) && !s.allows(kindNumber) {
			return false
		}
		if s.min != nil || s.max != nil || s.exMin != nil || s.exMax != nil {
			if !s.intBounds || !s.intInBounds(i) {
				return false
			}
		}
		return !s.hasEnum || slices.ContainsFunc(s.enum, func(e any) bool {
			n, ok := e.(json.Number)
			if !ok {
				return false
			}
			ei, err := strconv.ParseInt(string(n), 10, 64)
			return err == nil && ei == i
		})
	}
}

// plainInteger: -?(0|[1-9][0-9]*), JSON's grammar of a whole number.
func plainInteger(tok []byte) bool {
	digits := bytes.TrimPrefix(tok, []byte("-"))
	if len(digits) == 0 || len(digits) > 1 && digits[0] == '0' {
		return false
	}
	for _, c := range digits {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// allows: a value of kind k passes the type keyword (an integer is a
// number too).
func (s *fastSchema) allows(k uint8) bool {
	return s.types == 0 || s.types&k != 0 || k == kindInteger && s.types&kindNumber != 0
}

func (s *fastSchema) intInBounds(i int64) bool {
	return (s.min == nil || i >= s.min.Num().Int64()) && (s.max == nil || i <= s.max.Num().Int64()) &&
		(s.exMin == nil || i > s.exMin.Num().Int64()) && (s.exMax == nil || i < s.exMax.Num().Int64())
}

func (s *fastSchema) validObject(r *reader) bool {
	if len(s.required) > 64 {
		return false
	}
	r.at++ // {
	r.depth++
	defer func() { r.depth-- }()
	var seen uint64
	if r.peek() == '}' {
		r.at++
		return s.allRequired(seen)
	}
	for {
		key, escaped, ok := r.str()
		// A key the decoder would change (an escape, bytes not UTF-8) is
		// not read here.
		if !ok || escaped || !utf8.Valid(key) || r.peek() != ':' {
			return false
		}
		r.at++
		p, known := s.props[string(key)]
		switch {
		case known:
			if !p.validValue(r) {
				return false
			}
		case s.closed:
			return false
		default:
			if !anyValue.validValue(r) {
				return false
			}
		}
		if i := slices.Index(s.required, string(key)); i >= 0 {
			seen |= 1 << i
		}
		switch r.peek() {
		case ',':
			r.at++
		case '}':
			r.at++
			return s.allRequired(seen)
		default:
			return false
		}
	}
}

func (s *fastSchema) allRequired(seen uint64) bool {
	return seen == 1<<len(s.required)-1
}

func (s *fastSchema) validArray(r *reader) bool {
	r.at++ // [
	r.depth++
	defer func() { r.depth-- }()
	items := s.items
	if items == nil {
		items = anyValue
	}
	n := 0
	if r.peek() == ']' {
		r.at++
	} else {
		for {
			if !items.validValue(r) {
				return false
			}
			n++
			if c := r.peek(); c == ',' {
				r.at++
				continue
			} else if c == ']' {
				r.at++
				break
			}
			return false
		}
	}
	return (s.minItems < 0 || n >= s.minItems) && (s.maxItems < 0 || n <= s.maxItems)
}

// anyValue passes every value it can read.
var anyValue = &fastSchema{minLen: -1, maxLen: -1, minItems: -1, maxItems: -1}
