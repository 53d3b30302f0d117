package config

import (
	"reflect"
	"strings"
	"time"
)

// Redacted is cfg (a configuration, a section, or a pointer to either) as
// a nested map, ready to print: secrets (passwords, tokens) replaced by
// "<redacted>" when set, and the credentials inside URLs masked (see
// RedactURL).
func Redacted(cfg any) map[string]any {
	return redactStruct(reflect.ValueOf(cfg))
}

func redactStruct(v reflect.Value) map[string]any {
	out := map[string]any{}
	fields(v, func(key string, fv reflect.Value) {
		switch {
		case fv.Kind() == reflect.Struct:
			out[key] = redactStruct(fv)
		case fv.Type() == reflect.TypeOf(time.Duration(0)):
			out[key] = time.Duration(fv.Int()).String()
		case fv.Kind() != reflect.String:
			out[key] = fv.Interface()
		case isSecret(key) && fv.String() != "":
			out[key] = "<redacted>"
		case isURL(key):
			out[key] = RedactURL(fv.String())
		default:
			out[key] = fv.Interface()
		}
	})
	return out
}

// isSecret reports whether a key holds a secret itself (password, token),
// not a path to one (password_file): SecretName's rule, so that a key
// added later with such a name is hidden without anyone remembering to.
func isSecret(key string) bool {
	return !strings.HasSuffix(key, "_file") && SecretName(key)
}

// isURL reports whether a key holds a URL, or a list of them, whose
// credentials are masked but the rest shown (url, otlp_endpoint).
func isURL(key string) bool {
	return key == "url" || strings.HasSuffix(key, "_url") || key == "endpoint" || strings.HasSuffix(key, "_endpoint")
}
