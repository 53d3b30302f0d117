package subscribers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
)

// Timings of the dependency breakers.
const (
	// probeTimeout bounds one probe: a dependency slower than this to answer
	// a ping is as good as down for the events waiting on it.
	probeTimeout = 2 * time.Second
	// probeMin and probeMax bound the wait between probes of a dependency
	// that is down; it doubles after every failed probe.
	probeMin = 100 * time.Millisecond
	probeMax = 5 * time.Second
	// flapWindow: a dependency that goes down again this soon after coming
	// back resumes its previous backoff instead of starting over, so one
	// that answers probes but still fails real work (an engine that pings
	// but refuses writes) is not hammered.
	flapWindow = 30 * time.Second
	// stillDownEvery is how often a long outage is logged again.
	stillDownEvery = 30 * time.Second
	// watchEvery is how often the dependencies that are up are probed in
	// the background, so that readiness (and the pause of new work) follows
	// an outage even while no event arrives to find it.
	watchEvery = 5 * time.Second
)

// Health is a breaker per dependency of one runner (or one backfill).
// While any dependency is down the runner takes no new work and holds the
// events it has; a prober per down dependency learns when it is back.
type Health struct {
	subscriber string
	logger     *slog.Logger
	obs        Observer

	mu      sync.Mutex
	deps    map[string]*dependencyState
	changed chan struct{} // closed (and replaced) when a dependency comes back

	ctx    context.Context // probers stop with it
	probes sync.WaitGroup
}

type dependencyState struct {
	probe func(context.Context) error
	down  bool
	// trial: a dependency without a probe, let through after its backoff;
	// the next real use decides (markUp or markDown). Still not ready.
	trial   bool
	since   time.Time // down since
	upAt    time.Time // last came back
	backoff time.Duration
	lastErr error
}

// NewHealth starts watching deps (probing those up every watchEvery) for
// subscriber, until ctx ends; Wait waits for its probers then.
func NewHealth(ctx context.Context, subscriber string, logger *slog.Logger, obs Observer, deps []Dependency) *Health {
	h := &Health{subscriber: subscriber, logger: logger, obs: obs, deps: map[string]*dependencyState{},
		changed: make(chan struct{}), ctx: ctx}
	for _, d := range deps {
		h.deps[d.Name] = &dependencyState{probe: d.Probe}
		obs.DependencyUp(subscriber, d.Name, 0)
	}
	h.probes.Go(h.watch)
	return h
}

// watch probes the dependencies that are up, every watchEvery, until the
// runner stops.
func (h *Health) watch() {
	t := time.NewTicker(watchEvery)
	defer t.Stop()
	for {
		select {
		case <-h.ctx.Done():
			return
		case <-t.C:
			h.ProbeAll(h.ctx)
		}
	}
}

// MarkDown opens the dependency's breaker (if it is not open already) and
// starts probing it.
func (h *Health) MarkDown(name string, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	d := h.deps[name]
	if d == nil {
		// A dependency the handler did not declare: no probe, so it is
		// tried again after the backoff (the next real attempt decides).
		d = &dependencyState{}
		h.deps[name] = d
	}
	d.lastErr = err
	if d.down {
		return
	}
	if d.trial {
		// The same outage: the trial use failed. Back off further, quietly.
		d.trial, d.down = false, true
		d.backoff = min(2*d.backoff, probeMax)
		h.probes.Go(func() { h.probeUntilUp(name, d) })
		return
	}
	now := time.Now()
	d.down, d.since = true, now
	if !d.upAt.IsZero() && now.Sub(d.upAt) < flapWindow && d.backoff > 0 {
		d.backoff = min(2*d.backoff, probeMax)
	} else {
		d.backoff = probeMin
	}
	h.logger.Warn("dependency unavailable: holding the events in hand and taking no new ones until it answers",
		"dependency", name, "error", err, "retry_in", d.backoff)
	h.obs.DependencyDown(h.subscriber, name)
	h.probes.Go(func() { h.probeUntilUp(name, d) })
}

func (h *Health) probeUntilUp(name string, d *dependencyState) {
	h.mu.Lock()
	wait := d.backoff
	h.mu.Unlock()
	logged := time.Now()
	for {
		// Jitter, so instances of a subscriber do not probe in step.
		t := time.NewTimer(wait + rand.N(wait/5+1))
		select {
		case <-h.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if d.probe == nil {
			h.mu.Lock()
			d.down, d.trial = false, true
			close(h.changed)
			h.changed = make(chan struct{})
			h.mu.Unlock()
			h.logger.Debug("trying the dependency again", "dependency", name)
			return
		}
		ctx, cancel := context.WithTimeout(h.ctx, probeTimeout)
		err := d.probe(ctx)
		cancel()
		if h.ctx.Err() != nil {
			return
		}
		h.mu.Lock()
		if err == nil {
			downFor := time.Since(d.since)
			d.down, d.upAt, d.backoff = false, time.Now(), wait
			close(h.changed)
			h.changed = make(chan struct{})
			h.mu.Unlock()
			h.logger.Info("dependency answers again: resuming", "dependency", name, "down_for", downFor.Round(time.Millisecond))
			h.obs.DependencyUp(h.subscriber, name, downFor)
			return
		}
		d.lastErr = err
		wait = min(2*wait, probeMax)
		d.backoff = wait
		since := d.since
		h.mu.Unlock()
		if time.Since(logged) >= stillDownEvery {
			h.logger.Warn("dependency still unavailable", "dependency", name, "down_for", time.Since(since).Round(time.Second), "error", err)
			logged = time.Now()
		}
	}
}

// markUp records that a real use of a dependency without a probe worked:
// an outage on trial is over.
func (h *Health) markUp(name string) {
	h.mu.Lock()
	d := h.deps[name]
	if d == nil || !d.trial {
		h.mu.Unlock()
		return
	}
	d.trial, d.upAt = false, time.Now()
	downFor := time.Since(d.since)
	h.mu.Unlock()
	h.logger.Info("dependency answers again: resuming", "dependency", name, "down_for", downFor.Round(time.Millisecond))
	h.obs.DependencyUp(h.subscriber, name, downFor)
}

// HandlerWorked records that the handler just succeeded: an undeclared
// dependency it named on trial (no probe) evidently works again.
func (h *Health) HandlerWorked() {
	h.mu.Lock()
	var trials []string
	for name, d := range h.deps {
		if d.trial && name != DependencyDeadLetters {
			trials = append(trials, name)
		}
	}
	h.mu.Unlock()
	for _, name := range trials {
		h.markUp(name)
	}
}

// WaitUp blocks until no dependency is down; it returns false if ctx ends
// while one is. With every dependency up it returns true at once, even if
// ctx has ended (a draining runner finishes what it has).
func (h *Health) WaitUp(ctx context.Context) bool {
	for {
		h.mu.Lock()
		anyDown := false
		for _, d := range h.deps {
			anyDown = anyDown || d.down
		}
		changed := h.changed
		h.mu.Unlock()
		if !anyDown {
			return true
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return false
		}
	}
}

// ProbeAll probes every dependency that has a probe, opens the breaker of
// each that fails, and reports whether any is down. It asks afresh each
// time: a probe from before the failure it judges could say "up" about a
// dependency that went down since. (Probes are pings; failures are few.)
func (h *Health) ProbeAll(ctx context.Context) bool {
	h.mu.Lock()
	probes := map[string]func(context.Context) error{}
	for name, d := range h.deps {
		if d.probe != nil && !d.down {
			probes[name] = d.probe
		}
	}
	h.mu.Unlock()

	errs := make(map[string]error, len(probes))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for name, probe := range probes {
		wg.Go(func() {
			pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), probeTimeout)
			defer cancel()
			err := probe(pctx)
			mu.Lock()
			errs[name] = err
			mu.Unlock()
		})
	}
	wg.Wait()
	for name, err := range errs {
		if err != nil {
			h.MarkDown(name, err)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, d := range h.deps {
		if d.down {
			return true
		}
	}
	return false
}

// errNotReady is wrapped by ready's error.
var errNotReady = errors.New("dependencies unavailable")

// ready names the dependencies that are down, or returns nil.
func (h *Health) ready() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	var down []string
	for name, d := range h.deps {
		if d.down || d.trial {
			down = append(down, fmt.Sprintf("%s (down for %s: %v)", name, time.Since(d.since).Round(time.Second), d.lastErr))
		}
	}
	if len(down) == 0 {
		return nil
	}
	slices.Sort(down)
	return fmt.Errorf("subscriber %s: %w: %s", h.subscriber, errNotReady, strings.Join(down, "; "))
}

// Probe runs the named dependency's probe now, bounded as every probe is.
func (h *Health) Probe(ctx context.Context, name string) error {
	h.mu.Lock()
	d := h.deps[name]
	h.mu.Unlock()
	if d == nil || d.probe == nil {
		return fmt.Errorf("dependency %s has no probe", name)
	}
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	return d.probe(pctx)
}

// Wait returns once every prober has stopped (after ctx ended).
func (h *Health) Wait() { h.probes.Wait() }
