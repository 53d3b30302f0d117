// Package validate collects configuration problems, each naming its key
// and what is allowed, for the packages that own a section of the
// configuration (relay, subscribers, connect, ...) and for the rules that
// tie sections together.
package validate

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Errors collects problems; the zero value is ready.
type Errors struct{ errs []error }

// Bad records that key is wrong, and why.
func (e *Errors) Bad(key, format string, args ...any) {
	e.errs = append(e.errs, fmt.Errorf("%s %s", key, fmt.Sprintf(format, args...)))
}

// Between requires lo <= v <= hi.
func (e *Errors) Between(key string, v, lo, hi int64) {
	if v < lo || v > hi {
		e.Bad(key, "must be between %d and %d (got %d)", lo, hi, v)
	}
}

// Positive requires d > 0.
func (e *Errors) Positive(key string, d time.Duration) {
	if d <= 0 {
		e.Bad(key, "must be a positive duration such as 5s (got %s)", d)
	}
}

// OneOf requires v to be one of allowed.
func (e *Errors) OneOf(key, v string, allowed ...string) {
	if !slices.Contains(allowed, v) {
		e.Bad(key, "must be one of %s (got %q)", strings.Join(allowed, ", "), v)
	}
}

// Add records err, if not nil.
func (e *Errors) Add(err error) {
	if err != nil {
		e.errs = append(e.errs, err)
	}
}

// Err returns every problem recorded, or nil.
func (e *Errors) Err() error { return errors.Join(e.errs...) }
