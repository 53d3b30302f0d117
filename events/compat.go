package events

// Whether a new declaration of a type still accepts what readers of the
// released one were promised.

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
)

// Breaks lists what the declaration next breaks of released, the same
// type's declaration as last released: a property removed or retyped, a
// property newly required, properties closed (additionalProperties), at
// any depth of nested objects. A change that breaks nothing (a property
// added and optional, a description reworded) returns nil; so does an
// unchanged one. A change of any kind also needs a higher version, or the
// version names two schemas.
//
// Only a new type (its own name, so its own subject) may break: readers of
// the old type then keep reading what they were promised.
func Breaks(released, next *Type) []string {
	var old, cur map[string]any
	if err := json.Unmarshal(released.Schema, &old); err != nil {
		return []string{fmt.Sprintf("the released declaration of %s is not JSON: %v", released.Name, err)}
	}
	if err := json.Unmarshal(next.Schema, &cur); err != nil {
		return []string{fmt.Sprintf("the declaration of %s is not JSON: %v", next.Name, err)}
	}
	var problems []string
	if next.AggregateType != released.AggregateType {
		problems = append(problems, fmt.Sprintf("the aggregate type changed from %s to %s", released.AggregateType, next.AggregateType))
	}
	problems = append(problems, objectBreaks("", old, cur)...)
	if !sameSchema(old, cur) && next.Version <= released.Version {
		problems = append(problems, fmt.Sprintf("the schema changed but its version did not go up (released %d, now %d)", released.Version, next.Version))
	}
	return problems
}

// objectBreaks compares the schemas at pointer at: their rules, what
// they require, whether they stay open, and each property they had.
func objectBreaks(at string, old, cur map[string]any) []string {
	var problems []string
	where := at
	if where == "" {
		where = "the payload"
	}
	_, oldItems := old["items"].(map[string]any)
	_, curItems := cur["items"].(map[string]any)
	if was, now := rules(old), rules(cur); was != now || oldItems != curItems {
		problems = append(problems, fmt.Sprintf("%s: its rules changed from %s to %s", where, was, now))
	}
	for _, name := range stringsOf(cur["required"]) {
		if !slices.Contains(stringsOf(old["required"]), name) {
			problems = append(problems, fmt.Sprintf("%s: property %q is required now", where, name))
		}
	}
	for _, name := range stringsOf(old["required"]) {
		if !slices.Contains(stringsOf(cur["required"]), name) {
			problems = append(problems, fmt.Sprintf("%s: property %q is no longer required: readers counted on it", where, name))
		}
	}
	if isOpen(old) && !isOpen(cur) {
		problems = append(problems, fmt.Sprintf("%s: additionalProperties now refuses properties a later version may add", where))
	}
	_, wasSchema := old["additionalProperties"].(map[string]any)
	_, isSchema := cur["additionalProperties"].(map[string]any)
	if wasSchema || isSchema {
		was, _ := json.Marshal(demands(old["additionalProperties"]))
		now, _ := json.Marshal(demands(cur["additionalProperties"]))
		if string(was) != string(now) {
			problems = append(problems, fmt.Sprintf("%s: additionalProperties changed from %s to %s", where, was, now))
		}
	}
	if was, ok := old["items"].(map[string]any); ok {
		if now, ok := cur["items"].(map[string]any); ok {
			problems = append(problems, objectBreaks(at+"/*", was, now)...)
		}
	}
	oldProps, _ := old["properties"].(map[string]any)
	curProps, _ := cur["properties"].(map[string]any)
	names := make([]string, 0, len(oldProps))
	for name := range oldProps {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		p := at + "/" + name
		now, ok := curProps[name].(map[string]any)
		if !ok {
			problems = append(problems, fmt.Sprintf("%s: property removed", p))
			continue
		}
		was, _ := oldProps[name].(map[string]any)
		problems = append(problems, objectBreaks(p, was, now)...)
	}
	if !isOpen(old) {
		// A reader holding the released schema refuses any property it
		// does not name.
		for name := range curProps {
			if _, ok := oldProps[name]; !ok {
				problems = append(problems, fmt.Sprintf("%s/%s: property added where the released schema refuses properties it does not name", at, name))
			}
		}
	}
	return problems
}

// notRules are the keywords that say nothing of which values pass (the
// annotations), and those objectBreaks compares one by one.
var notRules = append([]string{"$schema", "properties", "required", "additionalProperties", "items"}, annotations...)

// rules is what a schema demands of its value, besides its properties,
// as one comparable string: any change to it, widening or narrowing,
// changes which values pass in one direction or the other.
func rules(schema map[string]any) string {
	c := make(map[string]any, len(schema))
	for k, v := range schema {
		if !slices.Contains(notRules, k) && !strings.HasPrefix(k, "x-") {
			c[k] = demands(v)
		}
	}
	sortEnum(c)
	out, _ := json.Marshal(c) // a map marshals with sorted keys
	return string(out)
}

// isOpen: the schema lets through properties it does not name.
func isOpen(schema map[string]any) bool {
	ap, ok := schema["additionalProperties"]
	return !ok || ap == true
}

func stringsOf(v any) []string {
	list, _ := v.([]any)
	var out []string
	for _, x := range list {
		if s, ok := x.(string); ok {
			out = append(out, s)
		}
	}
	return out
}

// sameSchema: the two demand the same of a payload, whatever their
// layout and annotations (descriptions, the version and $id that name
// them).
func sameSchema(a, b map[string]any) bool {
	x, _ := json.Marshal(demands(a)) // a map marshals with sorted keys
	y, _ := json.Marshal(demands(b))
	return string(x) == string(y)
}

// annotations say nothing of which values pass (nor do x-* keywords;
// format is not asserted in draft 2020-12).
var annotations = []string{"title", "description", "examples", "default", "deprecated", "$comment", "$id", "format", versionKeyword}

// demands is v without its annotations, at every depth, an enum's values
// in one order.
func demands(v any) any {
	switch v := v.(type) {
	case map[string]any:
		c := make(map[string]any, len(v))
		for k, x := range v {
			if !slices.Contains(annotations, k) && !strings.HasPrefix(k, "x-") {
				c[k] = demands(x)
			}
		}
		sortEnum(c)
		return c
	case []any:
		c := make([]any, len(v))
		for i, x := range v {
			c[i] = demands(x)
		}
		return c
	}
	return v
}

// BreaksRelease lists what current breaks of released, the declarations
// as last released: a type no longer declared, and each type's Breaks.
func BreaksRelease(released, current *Catalog) []string {
	var problems []string
	for _, was := range released.Types() {
		now := current.Lookup(was.Name)
		if now == nil {
			problems = append(problems, fmt.Sprintf("%s: no longer declared", was.Name))
			continue
		}
		for _, p := range Breaks(was, now) {
			problems = append(problems, was.Name+": "+p)
		}
	}
	return problems
}

// sortEnum puts the values of a schema's enum (a copy: demands made it) in
// one order, so that a reordered enum compares equal.
func sortEnum(schema map[string]any) {
	if enum, ok := schema["enum"].([]any); ok {
		slices.SortFunc(enum, func(a, b any) int {
			x, _ := json.Marshal(a)
			y, _ := json.Marshal(b)
			return strings.Compare(string(x), string(y))
		})
	}
}
