package subscribers_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
)

// hanging never returns from Handle until released (it ignores its
// context, as a handler stuck in a call without a timeout would).
type hanging struct {
	release chan struct{}
	once    sync.Once
}

func (h *hanging) Handle(context.Context, subscribers.Event) error {
	<-h.release
	return nil
}
func (h *hanging) free() { h.once.Do(func() { close(h.release) }) }

// A subscriber whose handler never returns, while events wait, is stalled
// after subscribers.stall_after: readiness says so and why. One with
// nothing to do is not; and it is ready again once it finishes events.
func TestStalledSubscriberIsNotReady(t *testing.T) {
	env := subscribertest.NewEnv(t)
	h := &hanging{release: make(chan struct{})}
	obs := &stallObserver{}
	r := env.StartRunner(subscribertest.Declare("hanging", subscribers.Each(h), "test.>"), func(o *subscribers.Options) {
		o.Config.StallAfter = time.Second
		o.Config.HandlerTimeout = time.Minute
		o.Observer = obs
	})
	t.Cleanup(h.free) // before the runner stops

	time.Sleep(2500 * time.Millisecond)
	if err := r.Ready(); err != nil {
		t.Fatalf("idle, with nothing to do: not ready: %v", err)
	}

	written := time.Now()
	env.Write(func(pgx.Tx) ([]outbox.Event, error) {
		return []outbox.Event{{AggregateType: "test", AggregateID: "1", Type: "test.stall", Payload: map[string]int{"n": 1}}}, nil
	})
	subscribertest.WaitFor(t, 10*time.Second, "readiness to report the stall", func() (bool, string) {
		err := r.Ready()
		return err != nil && strings.Contains(err.Error(), "stalled"), "ready: " + errText(err)
	})
	// The idle seconds before did not count: the clock started when the
	// event began to wait (a tick, a tenth of stall_after, may pass first).
	if after := time.Since(written); after < 800*time.Millisecond {
		t.Errorf("stalled %s after the event was written, want stall_after (1s) less a tick at least", after.Round(time.Millisecond))
	}
	err := r.Ready()
	for _, want := range []string{"hanging", "1 events waiting", "subscribers.stall_after 1s"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("stall reported as %q, which does not say %q", err, want)
		}
	}

	h.free()
	subscribertest.WaitFor(t, 10*time.Second, "readiness to recover once events are finished", func() (bool, string) {
		err := r.Ready()
		return err == nil, "ready: " + errText(err)
	})
	if got := obs.states(); !slices.Equal(got, []bool{false, true, false}) {
		t.Errorf("the observer (fanout_subscriber_stalled) was told %v, want [false true false]: not stalled at start, stalled, recovered", got)
	}
}

// stallObserver records what the runner says of its stalls.
type stallObserver struct {
	subscribers.NopObserver
	mu  sync.Mutex
	got []bool
}

func (o *stallObserver) Stalled(_ string, stalled bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.got = append(o.got, stalled)
}

func (o *stallObserver) states() []bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.got)
}

func errText(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
