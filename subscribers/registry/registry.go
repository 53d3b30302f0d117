// Package registry lists the subscribers fanout runs. Everything else about
// a subscriber is derived from its declaration: `fanout subscribe` builds
// it, `fanout provision` creates its consumer, `fanout status` reports it,
// `fanout deploy` writes its NATS user, Postgres role and compose service,
// and the fault run and the least-privilege test exercise it.
//
// Adding a subscriber: see the README's "Adding a subscriber".
package registry

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/fanout/fanout/subscribers/searchindex"
)

var declared = []subscribers.Declaration{
	cacheinval.Subscriber,
	fulfilment.Subscriber,
	invoicing.Subscriber,
	salesledger.Subscriber,
	searchindex.Subscriber,
}

// Registry is a set of subscriber declarations, by name.
type Registry struct{ decls []subscribers.Declaration }

// Default is the registry of the subscribers fanout ships.
var Default = MustNew(append(append(declared, tagged...), taggedOrderStatus...)...)

// New returns a registry of decls, refusing an invalid declaration or a
// name declared twice.
func New(decls ...subscribers.Declaration) (*Registry, error) {
	var errs []error
	seen := map[string]bool{}
	for _, d := range decls {
		if err := d.Validate(); err != nil {
			errs = append(errs, err)
		}
		if seen[d.Name] {
			errs = append(errs, fmt.Errorf("subscriber %q declared twice", d.Name))
		}
		seen[d.Name] = true
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	sorted := slices.Clone(decls)
	slices.SortFunc(sorted, func(a, b subscribers.Declaration) int { return strings.Compare(a.Name, b.Name) })
	return &Registry{decls: sorted}, nil
}

// MustNew is New for declarations known at compile time.
func MustNew(decls ...subscribers.Declaration) *Registry {
	r, err := New(decls...)
	if err != nil {
		panic(err)
	}
	return r
}

// With returns a registry of r's declarations and decls.
func (r *Registry) With(decls ...subscribers.Declaration) (*Registry, error) {
	return New(append(slices.Clone(r.decls), decls...)...)
}

// All returns the declarations, by name.
func (r *Registry) All() []subscribers.Declaration { return slices.Clone(r.decls) }

// Names returns the subscribers' names, sorted.
func (r *Registry) Names() []string {
	names := make([]string, len(r.decls))
	for i, d := range r.decls {
		names[i] = d.Name
	}
	return names
}

// Lookup returns the declaration of name, or an error naming the known
// subscribers.
func (r *Registry) Lookup(name string) (subscribers.Declaration, error) {
	for _, d := range r.decls {
		if d.Name == name {
			return d, nil
		}
	}
	return subscribers.Declaration{}, fmt.Errorf("unknown subscriber %q (known: %s)", name, strings.Join(r.Names(), ", "))
}
