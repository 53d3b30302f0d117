package subscribers_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
)

// countingHandler counts the events its handler is called with.
type countingHandler struct{ calls atomic.Int64 }

func (h *countingHandler) Handle(context.Context, subscribers.Event) error {
	h.calls.Add(1)
	return nil
}

// skipCounter counts the events the runtime skipped as checkpointed.
type skipCounter struct {
	subscribers.NopObserver
	skipped atomic.Int64
}

func (o *skipCounter) Skipped(_ string, n int) { o.skipped.Add(int64(n)) }

// A replay is a request in Postgres that a running instance of the
// subscriber carries out: it moves its consumer, records the outcome under
// its own role, once, and its checkpoint skips what it handled. A request
// for another stream is refused with the reason; one no instance takes in
// time lapses, and an instance started later leaves it alone.
func TestAReplayIsCarriedOutByTheSubscriber(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx := context.Background()
	h := &countingHandler{}
	d := subscribertest.Declare("replayed", subscribers.Each(h), "test.>")
	// Two instances: one takes each request.
	obs := &skipCounter{}
	observed := func(o *subscribers.Options) { o.Observer = obs }
	env.StartRunner(d, observed)
	env.StartRunner(d, observed)
	env.Write(func(pgx.Tx) ([]outbox.Event, error) {
		var evs []outbox.Event
		for i := range 3 {
			evs = append(evs, outbox.Event{AggregateType: "test", AggregateID: "1", Type: "test.replay", Payload: map[string]int{"n": i}})
		}
		return evs, nil
	})
	env.WaitIdle("replayed", 15*time.Second)
	rs := bookkeeping.NewReplays(env.DB.Pool)
	outcome := func(id int64) bookkeeping.ReplayOutcome {
		t.Helper()
		var o bookkeeping.ReplayOutcome
		subscribertest.WaitFor(t, 15*time.Second, "the replay's outcome", func() (bool, string) {
			var err error
			o, err = rs.Outcome(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			return o.Outcome != bookkeeping.ReplayRequested, o.Outcome
		})
		return o
	}
	var role string
	if err := env.DB.Pool.QueryRow(ctx, `SELECT session_user`).Scan(&role); err != nil {
		t.Fatal(err)
	}
	id, err := rs.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "replayed", Stream: env.Config.Stream.Name, FromSeq: 1, Within: time.Minute, Reason: "fill a gap"})
	if err != nil {
		t.Fatal(err)
	}
	if o := outcome(id); o.Outcome != bookkeeping.ReplayMoved || o.Actor != role {
		t.Fatalf("replay outcome %+v, want moved, recorded by %s", o, role)
	}
	subscribertest.WaitFor(t, 60*time.Second, "the 3 events again, skipped", func() (bool, string) {
		n := obs.skipped.Load()
		return n >= 3, fmt.Sprintf("%d skipped", n)
	})
	env.WaitIdle("replayed", 15*time.Second)
	if n := h.calls.Load(); n != 3 {
		t.Errorf("handler called %d times, want 3: the checkpoint skips the replayed events", n)
	}
	var outcomes int
	if err := env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM replays WHERE request_id = $1`, id).Scan(&outcomes); err != nil || outcomes != 1 {
		t.Errorf("%d outcomes recorded (%v), want one for two instances", outcomes, err)
	}

	id, err = rs.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "replayed", Stream: "ELSEWHERE", FromSeq: 1, Within: time.Minute, Reason: "wrong stream"})
	if err != nil {
		t.Fatal(err)
	}
	if o := outcome(id); !strings.Contains(o.Outcome, "failed: subscriber replayed consumes stream "+env.Config.Stream.Name+", not ELSEWHERE") {
		t.Errorf("a replay of another stream: %+v, want it refused with the reason", o)
	}

	id, err = rs.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "absent", Stream: env.Config.Stream.Name, FromSeq: 1, Within: 1500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if o := outcome(id); o.Outcome != bookkeeping.ReplayLapsed {
		t.Fatalf("a replay no instance takes: %+v, want lapsed", o)
	}
	env.StartRunner(subscribertest.Declare("absent", subscribers.Each(&countingHandler{}), "test.>"), nil)
	// Once it has carried out a request made now, it has looked.
	later, err := rs.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "absent", Stream: env.Config.Stream.Name, FromSeq: 1, Within: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if o := outcome(later); o.Outcome != bookkeeping.ReplayMoved {
		t.Fatalf("a replay of the started subscriber: %+v, want moved", o)
	}
	if o, err := rs.Outcome(ctx, id); err != nil || o.Outcome != bookkeeping.ReplayLapsed {
		t.Errorf("a lapsed replay after its subscriber started: %+v (%v), want still lapsed", o, err)
	}

	// Forward, past what the consumer acknowledged, it would skip events.
	id, err = rs.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "replayed", Stream: env.Config.Stream.Name, FromSeq: 1_000_000, Within: time.Minute, Reason: "skip ahead"})
	if err != nil {
		t.Fatal(err)
	}
	if o := outcome(id); !strings.Contains(o.Outcome, "failed: sequence 1000000 is past the consumer's ack floor") {
		t.Errorf("a replay forward: %+v, want it refused", o)
	}

	for _, r := range []bookkeeping.ReplayRequest{
		{Subscriber: "replayed", Stream: env.Config.Stream.Name, FromSeq: 0, Within: time.Minute},
		{Subscriber: "replayed", Stream: env.Config.Stream.Name, FromSeq: 1, Within: 0},
		{Subscriber: "replayed", Stream: env.Config.Stream.Name, FromSeq: 1, Within: 48 * time.Hour},
	} {
		if _, err := rs.Request(ctx, r); err == nil {
			t.Errorf("request %+v accepted, want refused", r)
		}
	}
}

// A request made while the subscriber cannot reach Postgres waits: an
// outage is not the request's failure, and the instance carries it out
// once Postgres is back.
func TestAReplayWaitsOutAPostgresOutage(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx := context.Background()
	pool, proxy := env.ProxiedPool()
	env.StartRunner(subscribertest.Declare("patient", subscribers.Each(&countingHandler{}), "test.>"), func(o *subscribers.Options) { o.Pool = pool })
	env.Write(func(pgx.Tx) ([]outbox.Event, error) {
		return []outbox.Event{{AggregateType: "test", AggregateID: "1", Type: "test.patient", Payload: map[string]int{"n": 1}}}, nil
	})
	env.WaitIdle("patient", 15*time.Second)

	proxy.Cut()
	rs := bookkeeping.NewReplays(env.DB.Pool)
	id, err := rs.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "patient", Stream: env.Config.Stream.Name, FromSeq: 1, Within: time.Minute, Reason: "during an outage"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // three looks for requests, each cut off
	if o, err := rs.Outcome(ctx, id); err != nil || o.Outcome != bookkeeping.ReplayRequested {
		t.Fatalf("the request during the outage: %+v (%v), want it still requested", o, err)
	}
	proxy.Restore()
	subscribertest.WaitFor(t, 20*time.Second, "the replay once Postgres is back", func() (bool, string) {
		o, err := rs.Outcome(ctx, id)
		return err == nil && o.Outcome == bookkeeping.ReplayMoved, fmt.Sprintf("%+v %v", o, err)
	})
}

// A request made while NATS is down waits too: the failed reset is an
// outage, not the request's failure, and the instance carries it out once
// NATS is back.
func TestAReplayWaitsOutANATSOutage(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx := context.Background()
	env.StartRunner(subscribertest.Declare("patient", subscribers.Each(&countingHandler{}), "test.>"), nil)
	env.Write(func(pgx.Tx) ([]outbox.Event, error) {
		return []outbox.Event{{AggregateType: "test", AggregateID: "1", Type: "test.patient", Payload: map[string]int{"n": 1}}}, nil
	})
	env.WaitIdle("patient", 15*time.Second)

	env.NATS.Stop()
	rs := bookkeeping.NewReplays(env.DB.Pool)
	id, err := rs.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "patient", Stream: env.Config.Stream.Name, FromSeq: 1, Within: 2 * time.Minute, Reason: "during an outage"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Second) // looks for requests, each reset failing
	if o, err := rs.Outcome(ctx, id); err != nil || o.Outcome != bookkeeping.ReplayRequested {
		t.Fatalf("the request during the outage: %+v (%v), want it still requested", o, err)
	}
	if err := env.NATS.Restart(); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, 60*time.Second, "the replay once NATS is back", func() (bool, string) {
		o, err := rs.Outcome(ctx, id)
		return err == nil && o.Outcome == bookkeeping.ReplayMoved, fmt.Sprintf("%+v %v", o, err)
	})
}
