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
			out[key] = redactURLs(fv.String())
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

// redactURLs masks passwords in a comma-separated list of URLs.
func redactURLs(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		if u, err := url.Parse(strings.TrimSpace(p)); err == nil && u.User != nil {
			if _, has := u.User.Password(); has {
				parts[i] = u.Redacted()
			}
		}
	}
	return strings.Join(parts, ",")
}

// RedactURL masks a password in a URL, for messages and logs.
func RedactURL(raw string) string { return redactURLs(raw) }
