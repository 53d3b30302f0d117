package config

import (
	"reflect"
	"strings"
	"time"
)

// Redacted is the configuration as a nested map, ready to print: secrets
// (passwords, tokens) replaced by "<redacted>" when set, and the
// credentials inside URLs masked (see RedactURL).
func (c *Config) Redacted() map[string]any {
	out := redactStruct(reflect.ValueOf(*c))
	subs := out["subscribers"].(map[string]any)
	for name, o := range c.overrides {
		all := redactStruct(reflect.ValueOf(o))
		own := map[string]any{}
		for _, k := range SubscriberKeys {
			own[k] = all[k]
		}
		subs[name] = own
	}
	return out
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
		case fv.Kind() != reflect.String:
			out[key] = fv.Interface()
		case isSecret(key):
			if fv.String() != "" {
				out[key] = "<redacted>"
			} else {
				out[key] = ""
			}
		case isURL(key):
			out[key] = RedactURL(fv.String())
		default:
			out[key] = fv.Interface()
		}
	}
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
