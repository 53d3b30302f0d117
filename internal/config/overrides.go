package config

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"

	"github.com/knadh/koanf/v2"
)

// PerName lets each of Names set Keys of Section for itself, as
// <section>.<name>.<key> (FANOUT_<SECTION>_<NAME>_<KEY>): each subscriber
// its own ack wait, say. Into receives, for each name that sets any, the
// section as that name runs with it: the shared settings with its own over
// them. T is the section's type. Checking each name's settings (as a
// whole, with the rest of the configuration) is the configuration's
// Validate's work.
type PerName[T any] struct {
	// Section is the section's key ("subscribers").
	Section string
	// Noun names one of Names in errors ("subscriber").
	Noun string
	// Keys are the section's keys a name may set ("ack_wait", ...).
	Keys  []string
	Names []string
	Into  *map[string]T
}

func (p PerName[T]) apply(o *loadOptions) { o.perName = append(o.perName, p) }

// perName is a PerName of any type.
type perName interface {
	check(defaults map[string]any) error
	keys() []string
	decode(k *koanf.Koanf, root reflect.Value) error
}

// AllKeys returns the keys the names may set, sorted.
func (p PerName[T]) AllKeys() []string {
	var keys []string
	for _, name := range p.Names {
		for _, k := range p.Keys {
			keys = append(keys, p.Section+"."+name+"."+k)
		}
	}
	slices.Sort(keys)
	return keys
}

func (p PerName[T]) keys() []string { return p.AllKeys() }

// check refuses a name whose keys would collide with a shared key of the
// section, and a key the section does not have.
func (p PerName[T]) check(defaults map[string]any) error {
	var errs []error
	for _, k := range p.Keys {
		if _, ok := defaults[p.Section+"."+k]; !ok {
			errs = append(errs, fmt.Errorf("%s.%s is no key, so no %s can set it for itself", p.Section, k, p.Noun))
		}
	}
	for _, name := range p.Names {
		if name == "" || strings.Contains(name, ".") {
			errs = append(errs, fmt.Errorf("%s name %q cannot carry settings (%s.<name>.<key>)", p.Noun, name, p.Section))
			continue
		}
		if _, shared := defaults[p.Section+"."+name]; shared {
			errs = append(errs, fmt.Errorf("%s name %q is a %s.* key: its settings would collide with it", p.Noun, name, p.Section))
		}
	}
	return errors.Join(errs...)
}

// decode reads each name's own settings over a copy of the shared ones.
func (p PerName[T]) decode(k *koanf.Koanf, root reflect.Value) error {
	var shared T
	if err := Section(root.Interface(), p.Section, &shared); err != nil {
		return err
	}
	for _, name := range p.Names {
		prefix := p.Section + "." + name
		if !k.Exists(prefix) {
			continue
		}
		effective := shared
		if err := decode(k.Cut(prefix).Raw(), &effective); err != nil {
			return fmt.Errorf("decode %s: %w", prefix, err)
		}
		if *p.Into == nil {
			*p.Into = map[string]T{}
		}
		(*p.Into)[name] = effective
	}
	return nil
}
