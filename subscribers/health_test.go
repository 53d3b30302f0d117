package subscribers

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// flakyProbe fails until up is set.
type flakyProbe struct{ up, calls atomic.Int32 }

func (p *flakyProbe) probe(context.Context) error {
	p.calls.Add(1)
	if p.up.Load() == 0 {
		return errors.New("connection refused")
	}
	return nil
}

func newTestHealth(t *testing.T, deps ...Dependency) *Health {
	ctx, cancel := context.WithCancel(context.Background())
	h := NewHealth(ctx, "test", slog.New(slog.NewTextHandler(io.Discard, nil)), NopObserver{}, deps)
	t.Cleanup(func() {
		cancel()
		h.Wait()
	})
	return h
}

// A dependency marked down holds the work (WaitUp waits, readiness names
// it) until its prober finds it back.
func TestHealthHoldsWorkUntilTheDependencyAnswers(t *testing.T) {
	p := &flakyProbe{}
	h := newTestHealth(t, Dependency{Name: "redis", Probe: p.probe})
	if err := h.ready(); err != nil {
		t.Fatalf("ready before any outage: %v", err)
	}
	h.MarkDown("redis", errors.New("dial tcp: connection refused"))
	if err := h.ready(); err == nil || !strings.Contains(err.Error(), "redis") {
		t.Fatalf("readiness during the outage: %v, want it to name redis", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	if h.WaitUp(ctx) {
		t.Fatal("WaitUp returned while redis was down")
	}
	cancel()
	p.up.Store(1)
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !h.WaitUp(ctx) {
		t.Fatal("WaitUp did not return once redis answered its probe")
	}
	if err := h.ready(); err != nil {
		t.Fatalf("ready after the outage: %v", err)
	}
	if p.calls.Load() < 2 {
		t.Fatalf("%d probes: the prober did not retry", p.calls.Load())
	}
}

// A dependency without a probe is let through after its backoff, on
// trial: still not ready, until a real use works.
func TestHealthTriesADependencyWithoutAProbe(t *testing.T) {
	h := newTestHealth(t, Dependency{Name: DependencyDeadLetters})
	h.MarkDown(DependencyDeadLetters, errors.New("no responders"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !h.WaitUp(ctx) {
		t.Fatal("a dependency without a probe was never tried again")
	}
	if err := h.ready(); err == nil {
		t.Fatal("ready while the dead letters are on trial")
	}
	h.markUp(DependencyDeadLetters)
	if err := h.ready(); err != nil {
		t.Fatalf("ready after a real use worked: %v", err)
	}
}

// The verdict on a handler's failure: the event's fault only if every
// dependency answers.
func TestHealthJudgesAFailureAnOutageWhileADependencyIsDown(t *testing.T) {
	p := &flakyProbe{}
	p.up.Store(1)
	h := newTestHealth(t, Dependency{Name: "search", Probe: p.probe})
	ctx := context.Background()
	boom := errors.New("boom")
	for _, c := range []struct {
		err  error
		want Outcome
	}{
		{boom, OutcomeFailed},
		{Permanent(boom), OutcomePermanent},
		{RetryAfter(time.Second, boom), OutcomeSnooze},
		{errOutOfTurn, OutcomeRetry},
		{Unavailable("search", boom), OutcomeOutage},
	} {
		if got := h.Judge(ctx, c.err); got != c.want {
			t.Errorf("Judge(%v) = %d, want %d", c.err, got, c.want)
		}
		p.up.Store(1)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		h.WaitUp(wctx)
		cancel()
	}
	p.up.Store(0)
	if got := h.Judge(ctx, boom); got != OutcomeOutage {
		t.Errorf("Judge of a plain failure while search does not answer = %d, want an outage", got)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if got := h.Judge(cctx, boom); got != OutcomeAbandoned {
		t.Errorf("Judge after a stop = %d, want abandoned", got)
	}
	if err := h.Probe(ctx, "search"); err == nil {
		t.Error("Probe of a dependency that does not answer: nil")
	}
	if err := h.Probe(ctx, "nothing"); err == nil {
		t.Error("Probe of an unknown dependency: nil")
	}
}
