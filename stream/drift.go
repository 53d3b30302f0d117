package stream

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"
)

// Drift holds what differs, as of the last check, between the live streams
// and consumers a role depends on and fanout's configuration of them. A
// difference makes the role not ready (Err), is logged once with both
// values when it appears and again when it goes, and is reported to count
// (a gauge per object).
type Drift struct {
	logger *slog.Logger
	count  func(object string, n int)
	mu     sync.Mutex
	now    map[string][]Difference // by object: "stream EVENTS", "consumer invoicing"
}

// NewDrift returns a Drift that logs to logger and reports each object's
// number of differences to count.
func NewDrift(logger *slog.Logger, count func(object string, n int)) *Drift {
	return &Drift{logger: logger, count: count, now: map[string][]Difference{}}
}

// Set records object's differences as of now.
func (d *Drift) Set(object string, ds []Difference) {
	d.mu.Lock()
	defer d.mu.Unlock()
	before := d.now[object]
	for _, x := range ds {
		if !slices.Contains(before, x) {
			d.logger.Error("a setting differs from fanout's configuration: this role reports not ready until it is restored (`fanout provision --check` lists every difference)",
				"object", object, "field", x.Field, "have", x.Have, "want", x.Want, "lowers_a_limit", x.Lowers)
		}
	}
	for _, x := range before {
		if !slices.ContainsFunc(ds, func(y Difference) bool { return y.Field == x.Field }) {
			d.logger.Info("a setting is as configured again", "object", object, "field", x.Field, "value", x.Want)
		}
	}
	if len(ds) == 0 {
		delete(d.now, object)
	} else {
		d.now[object] = ds
	}
	d.count(object, len(ds))
}

// Err is nil when nothing differs, or says what does.
func (d *Drift) Err() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.now) == 0 {
		return nil
	}
	var parts []string
	for _, object := range slices.Sorted(maps.Keys(d.now)) {
		parts = append(parts, object+": "+Join(d.now[object]))
	}
	return fmt.Errorf("differs from fanout's configuration: %s", strings.Join(parts, "; "))
}

// Missing is the difference of an object that does not exist: a stream or
// consumer deleted is not an outage to wait out.
var Missing = []Difference{{Field: "exists", Have: "no", Want: "yes"}}

// Watch runs check every interval until ctx ends. A check that cannot
// reach the server changes nothing: an outage is not a difference.
func Watch(ctx context.Context, interval time.Duration, check func(ctx context.Context)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			cctx, cancel := context.WithTimeout(ctx, min(interval, 10*time.Second))
			check(cctx)
			cancel()
		}
	}
}
