package config

import (
	"net/url"
	"reflect"
	"strings"
	"time"
)

// Redacted is the configuration as a nested map, ready to print: secrets
// (passwords, tokens) replaced by "<redacted>" when set, and any password
// inside a URL masked.
func (c *Config) Redacted() map[string]any {
	return redactStruct(reflect.ValueOf(*c))
}

func redactStruct(v reflect.Value) map[string]any {
	out := map[string]any{}
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		key := f.Tag.Get("koanf")
		if key == "" {
			continue
		}
		fv := v.Field(i)
		switch {
		case fv.Kind() == reflect.Struct:
			out[key] = redactStruct(fv)
		case fv.Type() == reflect.TypeOf(time.Duration(0)):
			out[key] = time.Duration(fv.Int()).String()
		case isSecret(key):
			if fv.String() != "" {
				out[key] = "<redacted>"
			} else {
				out[key] = ""
			}
		case key == "url":
			out[key] = RedactURL(fv.String())
		default:
			out[key] = fv.Interface()
		}
	}
	return out
}

// isSecret reports whether a key holds a secret itself (not a path to one).
func isSecret(key string) bool {
	return key == "password" || key == "token"
}

// RedactURL masks the passwords in a URL, or a comma-separated list of
// them, for messages, logs and `config print`. A part that does not parse
// is not shown at all: it might hold a password in a form we cannot see.
func RedactURL(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		u, err := url.Parse(strings.TrimSpace(p))
		switch {
		case err != nil:
			parts[i] = "(unparseable URL)"
		case u.User != nil:
			if _, has := u.User.Password(); has {
				parts[i] = u.Redacted()
			}
		}
	}
	return strings.Join(parts, ",")
}
