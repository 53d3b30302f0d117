package config

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"strings"

	"github.com/go-viper/mapstructure/v2"
	"github.com/knadh/koanf/parsers/yaml"
	"github.com/knadh/koanf/providers/confmap"
	"github.com/knadh/koanf/providers/file"
	"github.com/knadh/koanf/v2"
)

// Validator is a section that checks itself, or a whole configuration.
// Its errors name the key that is wrong (see package validate).
type Validator interface {
	Validate() error
}

// Option changes what Load accepts.
type Option interface {
	apply(*loadOptions)
}

type loadOptions struct {
	replaced map[string]string
	perName  []perName
}

type optionFunc func(*loadOptions)

func (f optionFunc) apply(o *loadOptions) { f(o) }

// Replaced names keys of earlier versions, each with what replaced it: a
// file or a variable that still sets one is refused with that, not
// silently ignored.
func Replaced(keys map[string]string) Option {
	return optionFunc(func(o *loadOptions) {
		if o.replaced == nil {
			o.replaced = map[string]string{}
		}
		for k, why := range keys {
			o.replaced[k] = why
		}
	})
}

// Load builds a configuration into cfg, a pointer to a struct whose fields
// are its sections: structs whose fields are the keys, both named by their
// koanf tags (field Relay `koanf:"relay"` holds field BatchSize
// `koanf:"batch_size"`, the key relay.batch_size). The keys are the
// fields: there is no other list of them.
//
// The values cfg holds when Load is called are the defaults (each
// section's own). Over them come the YAML file at path, if path is not
// empty, and then the FANOUT_ variables in environ (as os.Environ returns
// them). A key that no field declares is refused, and so is one that
// Replaced names. A string key X_file beside a string key X is a file
// holding X (a container secret): Load reads it when X is empty. Last,
// Load calls cfg.Validate, which checks each section (ValidateSections)
// and the rules that tie sections together.
func Load(cfg Validator, path string, environ []string, opts ...Option) error {
	var o loadOptions
	for _, opt := range opts {
		opt.apply(&o)
	}
	root, err := structOf(cfg)
	if err != nil {
		return err
	}
	defaults := map[string]any{}
	flatten(root, "", defaults)
	known := map[string]bool{}
	for key := range defaults {
		known[key] = true
	}
	var errs []error
	for _, p := range o.perName {
		errs = append(errs, p.check(defaults))
		for _, key := range p.keys() {
			known[key] = true
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}

	k := koanf.New(".")
	if err := k.Load(confmap.Provider(defaults, "."), nil); err != nil {
		return fmt.Errorf("load defaults: %w", err)
	}
	if path != "" {
		if err := k.Load(file.Provider(path), yaml.Parser()); err != nil {
			return fmt.Errorf("read config file %s: %w", path, err)
		}
	}
	env, err := envValues(environ, known, o.replaced)
	if err != nil {
		return err
	}
	if err := k.Load(confmap.Provider(env, "."), nil); err != nil {
		return fmt.Errorf("load environment: %w", err)
	}
	for _, key := range k.Keys() {
		if why, ok := o.replaced[key]; ok {
			return fmt.Errorf("config key %q is gone: %s", key, why)
		}
		if !known[key] {
			return fmt.Errorf("unknown config key %q (see `fanout config keys`)", key)
		}
	}

	if err := decode(k.Raw(), cfg); err != nil {
		return fmt.Errorf("decode config: %w", err)
	}
	for _, p := range o.perName {
		if err := p.decode(k, root); err != nil {
			return err
		}
	}
	if err := readSecretFiles(root); err != nil {
		return err
	}
	return cfg.Validate()
}

// structOf is the struct cfg points to.
func structOf(cfg any) (reflect.Value, error) {
	v := reflect.ValueOf(cfg)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		return reflect.Value{}, fmt.Errorf("configuration: want a non-nil pointer to a struct, got %T", cfg)
	}
	return v.Elem(), nil
}

// fields calls fn with each exported field of struct v that has a koanf
// tag, and that tag.
func fields(v reflect.Value, fn func(key string, f reflect.Value)) {
	for v.Kind() == reflect.Pointer {
		v = v.Elem()
	}
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		key := f.Tag.Get("koanf")
		if !f.IsExported() || key == "" || key == "-" {
			continue
		}
		fn(key, v.Field(i))
	}
}

// flatten lists the keys of struct v under prefix with their values, as
// they are (durations stay durations); a struct field holds keys of its
// own (a section).
func flatten(v reflect.Value, prefix string, out map[string]any) {
	fields(v, func(key string, f reflect.Value) {
		if f.Kind() == reflect.Struct {
			flatten(f, prefix+key+".", out)
			return
		}
		out[prefix+key] = f.Interface()
	})
}

// Keys returns every key of cfg (a configuration, or a pointer to one, as
// Load takes it), sorted.
func Keys(cfg any) []string {
	m := map[string]any{}
	flatten(reflect.ValueOf(cfg), "", m)
	return slices.Sorted(maps.Keys(m))
}

// ValidateSections calls the Validate method of each section of cfg (a
// configuration, or a pointer to one, as Load takes it), in order, and
// returns every problem found. A section without one is an error: every
// key has a valid range, if only "anything".
func ValidateSections(cfg any) error {
	var errs []error
	fields(reflect.ValueOf(cfg), func(key string, f reflect.Value) {
		v, ok := f.Interface().(Validator)
		if !ok {
			errs = append(errs, fmt.Errorf("config section %s (%s) has no Validate method", key, f.Type()))
			return
		}
		if err := v.Validate(); err != nil {
			errs = append(errs, err)
		}
	})
	return errors.Join(errs...)
}

// Section reads the section key ("redis", "search", ...) of cfg (a
// configuration, or a pointer to one) into v: a pointer to that section's
// own type, or to any struct whose koanf tags name the settings wanted.
// It is how a subscriber reads the settings of the services it uses
// (subscribers.Settings).
func Section(cfg any, key string, v any) error {
	found := false
	var err error
	fields(reflect.ValueOf(cfg), func(k string, f reflect.Value) {
		if k != key || found {
			return
		}
		found = true
		out := reflect.ValueOf(v)
		if out.Kind() != reflect.Pointer || out.IsNil() {
			err = fmt.Errorf("config section %s: want a non-nil pointer, got %T", key, v)
			return
		}
		if out.Elem().Type() == f.Type() {
			out.Elem().Set(f)
			return
		}
		if f.Kind() != reflect.Struct {
			err = fmt.Errorf("config section %s: %s is a key, not a section", key, key)
			return
		}
		m := map[string]any{}
		flatten(f, "", m)
		if e := decode(m, v); e != nil {
			err = fmt.Errorf("config section %s: %w", key, e)
		}
	})
	if !found {
		return fmt.Errorf("no config section %q", key)
	}
	return err
}

func decode(in map[string]any, out any) error {
	d, err := mapstructure.NewDecoder(&mapstructure.DecoderConfig{
		DecodeHook:       mapstructure.StringToTimeDurationHookFunc(),
		WeaklyTypedInput: true,
		Result:           out,
		TagName:          "koanf",
	})
	if err != nil {
		return err
	}
	return d.Decode(in)
}

// readSecretFiles reads each X_file key of each section into the string
// key X beside it, unless X is set.
func readSecretFiles(root reflect.Value) error {
	var errs []error
	fields(root, func(section string, s reflect.Value) {
		if s.Kind() != reflect.Struct {
			return
		}
		byKey := map[string]reflect.Value{}
		fields(s, func(key string, f reflect.Value) { byKey[key] = f })
		fields(s, func(key string, f reflect.Value) {
			name, ok := strings.CutSuffix(key, "_file")
			value, has := byKey[name]
			if !ok || !has || f.Kind() != reflect.String || value.Kind() != reflect.String {
				return
			}
			if f.String() == "" || value.String() != "" {
				return
			}
			b, err := os.ReadFile(f.String())
			if err != nil {
				errs = append(errs, fmt.Errorf("%s.%s: %w", section, key, err))
				return
			}
			value.SetString(strings.TrimRight(string(b), "\r\n"))
		})
	})
	// The first stops the load.
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// EnvPrefix starts every environment variable that sets a key.
const EnvPrefix = "FANOUT_"

// EnvName returns the environment variable that sets key.
func EnvName(key string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(key, ".", "_"))
}

// envNotKeys are FANOUT_ variables that are not configuration keys: the
// config file path, and the prefixes used by the tests and dev scripts.
var envNotKeys = []string{"FANOUT_CONFIG", "FANOUT_TEST_", "FANOUT_DEV_"}

// envValues maps FANOUT_* variables onto keys. Matching against the known
// keys, rather than splitting on "_", is what lets keys contain underscores.
func envValues(environ []string, known map[string]bool, replaced map[string]string) (map[string]any, error) {
	byEnv := make(map[string]string)
	for key := range known {
		byEnv[EnvName(key)] = key
	}
	out := make(map[string]any)
	for _, kv := range environ {
		name, value, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, EnvPrefix) {
			continue
		}
		if slices.ContainsFunc(envNotKeys, func(p string) bool { return strings.HasPrefix(name, p) }) {
			continue
		}
		key, ok := byEnv[name]
		for old, why := range replaced {
			if name == EnvName(old) {
				return nil, fmt.Errorf("environment variable %s: config key %q is gone: %s", name, old, why)
			}
		}
		if !ok {
			return nil, fmt.Errorf("environment variable %s names no config key (see `fanout config keys`)", name)
		}
		out[key] = value
	}
	return out, nil
}
