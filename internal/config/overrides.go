package config

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/go-viper/mapstructure/v2"
	"github.com/knadh/koanf/v2"
)

// SubscriberKeys are the subscribers.* keys each subscriber may set for
// itself, as subscribers.<name>.<key> (FANOUT_SUBSCRIBERS_<NAME>_<KEY>): how
// it takes and handles its events. A subscriber without its own value
// takes the shared one. The other subscribers.* keys (the dead-letter
// stream, the shutdown timeout) are one setting for all.
var SubscriberKeys = []string{"concurrency", "batch_size", "ack_wait", "handler_timeout", "max_failures", "max_crashes",
	"max_ack_pending", "retry_min", "retry_max", "start", "start_time", "stall_after",
	"on_dead_letter", "gap_wait", "pinned_ttl"}

// LoadOption changes what Load accepts.
type LoadOption func(*loadOptions)

type loadOptions struct{ subscribers []string }

// WithSubscribers lets each named subscriber override SubscriberKeys.
func WithSubscribers(names ...string) LoadOption {
	return func(o *loadOptions) { o.subscribers = append(o.subscribers, names...) }
}

// SubscriberOverrideKeys are the keys the subscribers names may set for
// themselves, sorted.
func SubscriberOverrideKeys(names ...string) []string {
	var keys []string
	for _, name := range names {
		for _, k := range SubscriberKeys {
			keys = append(keys, "subscribers."+name+"."+k)
		}
	}
	slices.Sort(keys)
	return keys
}

// checkSubscriberNames refuses a subscriber whose overrides would collide
// with a shared subscribers.* key.
func checkSubscriberNames(names []string) error {
	var errs []error
	for _, name := range names {
		if name == "" || strings.Contains(name, ".") {
			errs = append(errs, fmt.Errorf("subscriber name %q cannot carry settings (subscribers.<name>.<key>)", name))
			continue
		}
		if _, shared := defaults()["subscribers."+name]; shared {
			errs = append(errs, fmt.Errorf("subscriber name %q is a subscribers.* key: its settings would collide with it", name))
		}
	}
	return errors.Join(errs...)
}

// decodeOverrides reads each subscriber's own settings over a copy of the
// shared ones.
func (c *Config) decodeOverrides(k *koanf.Koanf, names []string) error {
	for _, name := range names {
		prefix := "subscribers." + name
		if !k.Exists(prefix) {
			continue
		}
		effective := c.Subscribers
		if err := decode(k.Cut(prefix).Raw(), &effective); err != nil {
			return fmt.Errorf("decode %s: %w", prefix, err)
		}
		if c.overrides == nil {
			c.overrides = map[string]Subscribers{}
		}
		c.overrides[name] = effective
	}
	return nil
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

// Subscriber returns the settings subscriber name runs with: the shared
// subscribers.* keys, and its own subscribers.<name>.* over them.
func (c *Config) Subscriber(name string) Subscribers {
	if o, ok := c.overrides[name]; ok {
		return o
	}
	return c.Subscribers
}

// SetSubscriberStart sets where new consumers start, for every subscriber
// (a command-line flag that outranks the files and the environment).
func (c *Config) SetSubscriberStart(start string) {
	c.Subscribers.Start = start
	for name, o := range c.overrides {
		o.Start = start
		c.overrides[name] = o
	}
}

// validateOverrides checks each subscriber's settings as a whole, as the
// shared ones are checked, naming the subscriber.
func (c *Config) validateOverrides() error {
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(c.overrides)) {
		one := *c
		one.Subscribers, one.overrides = c.overrides[name], nil
		if err := one.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("with the subscribers.%s.* settings: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// Section reads the section key ("redis", "search", ...) into v: a pointer
// to that section's own type, or to any struct whose koanf tags name the
// settings wanted. It is how a subscriber reads the settings of the
// services it uses (subscribers.Settings).
func (c *Config) Section(key string, v any) error {
	cv := reflect.ValueOf(c).Elem()
	for i := range cv.NumField() {
		f := cv.Type().Field(i)
		if f.Tag.Get("koanf") != key {
			continue
		}
		out := reflect.ValueOf(v)
		if out.Kind() != reflect.Pointer || out.IsNil() {
			return fmt.Errorf("config section %s: want a non-nil pointer, got %T", key, v)
		}
		if out.Elem().Type() == f.Type {
			out.Elem().Set(cv.Field(i))
			return nil
		}
		if err := decode(structToMap(cv.Field(i)), v); err != nil {
			return fmt.Errorf("config section %s: %w", key, err)
		}
		return nil
	}
	return fmt.Errorf("no config section %q", key)
}

// structToMap lists a settings struct's fields by their koanf keys, values
// as they are (durations stay durations).
func structToMap(v reflect.Value) map[string]any {
	out := map[string]any{}
	for i := range v.NumField() {
		if key := v.Type().Field(i).Tag.Get("koanf"); key != "" && v.Type().Field(i).IsExported() {
			out[key] = v.Field(i).Interface()
		}
	}
	return out
}
