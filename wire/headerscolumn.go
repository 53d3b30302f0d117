package wire

import (
	"encoding/json"
	"fmt"

	"github.com/fanout/fanout/outbox"
)

// decodeHeaders reads the headers column: a JSON object whose values are
// all strings, each header valid by outbox.ValidateHeaders. The writer API
// only stores such objects, but the schema allows any jsonb, and nothing is
// guessed: a null, a number or a nested object is not a header value a
// subscriber could rely on, so the row fails with the reason instead of
// being published with something other than what its writer meant.
func decodeHeaders(raw []byte) (map[string]string, error) {
	// jsonb prints an empty object as "{}": most rows, no decoder needed.
	if string(raw) == "{}" {
		return nil, nil
	}
	if len(raw) == 0 || raw[0] != '{' {
		return nil, fmt.Errorf("%w: headers must be a JSON object of strings, not %s", outbox.ErrInvalidEvent, jsonKind(raw))
	}
	var obj map[string]any
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, fmt.Errorf("%w: headers: %v", outbox.ErrInvalidEvent, err)
	}
	headers := make(map[string]string, len(obj))
	var badName, badKind string
	for k, v := range obj {
		s, ok := v.(string)
		if !ok {
			// Name the first bad header by name, so the reason is the same
			// whatever the map's iteration order.
			if badKind == "" || k < badName {
				badName, badKind = k, kindOf(v)
			}
			continue
		}
		headers[k] = s
	}
	if badKind != "" {
		return nil, fmt.Errorf("%w: header %q is %s, not a string: headers must be a JSON object of strings", outbox.ErrInvalidEvent, clipName(badName), badKind)
	}
	if err := outbox.ValidateHeaders(headers); err != nil {
		return nil, err
	}
	return headers, nil
}

// jsonKind names the kind of the JSON value raw holds, by its first byte
// (jsonb prints no leading whitespace).
func jsonKind(raw []byte) string {
	if len(raw) == 0 {
		return "empty"
	}
	switch raw[0] {
	case 'n':
		return "null"
	case 't', 'f':
		return "a boolean"
	case '"':
		return "a string"
	case '[':
		return "an array"
	case '{':
		return "an object"
	default:
		return "a number"
	}
}

// kindOf names the kind of a decoded JSON value.
func kindOf(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case float64:
		return "a number"
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	default:
		return fmt.Sprintf("a %T", v)
	}
}

// clipName cuts a header name for a reason (which quotes it with %q): it
// names the header, it need not repeat a long one.
func clipName(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
