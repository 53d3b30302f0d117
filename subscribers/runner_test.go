package subscribers_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// scripted is a test subscriber whose events say how to behave.
type scripted struct {
	name  string
	types []string
	mu    sync.Mutex
	seen  map[int64][]uint64 // deliveries seen per event
	at    map[int64][]time.Time
	done  map[int64]bool
}

type script struct {
	Behave string `json:"behave"` // ok, fail, retry, permanent, hang, slow
	Fails  int    `json:"fails"`  // for fail: fail this many deliveries, then succeed
	Millis int    `json:"millis"` // for slow: how long the work takes (2500 if 0)
}

func newScripted(name string, types ...string) *scripted {
	if len(types) == 0 {
		types = []string{"test.>"}
	}
	return &scripted{name: name, types: types, seen: map[int64][]uint64{}, at: map[int64][]time.Time{}, done: map[int64]bool{}}
}

// scriptedHandler is a scripted subscriber, or a handler around one.
type scriptedHandler interface {
	subscribers.EventHandler
	script() *scripted
}

func (s *scripted) script() *scripted { return s }

// each declares h as a subscriber whose effects are outside Postgres,
// named and typed as its script says.
func each(h scriptedHandler) subscribers.Declaration {
	s := h.script()
	return subscribertest.Declare(s.name, subscribers.Each(h), s.types...)
}

func (s *scripted) Handle(ctx context.Context, ev subscribers.Event) error {
	var sc script
	_ = json.Unmarshal(ev.Payload, &sc)
	s.mu.Lock()
	s.seen[ev.ID] = append(s.seen[ev.ID], ev.Delivery)
	s.at[ev.ID] = append(s.at[ev.ID], time.Now())
	s.mu.Unlock()
	var err error
	switch sc.Behave {
	case "fail":
		if int(ev.Delivery) <= sc.Fails {
			err = errors.New("transient trouble")
		}
	case "retry":
		if ev.Delivery == 1 {
			err = subscribers.RetryAfter(700*time.Millisecond, errors.New("not yet"))
		}
	case "permanent":
		err = subscribers.Permanent(errors.New("this event is nonsense"))
	case "hang":
		<-ctx.Done() // never returns in time: the ack wait expires
		err = ctx.Err()
	case "slow":
		took := 2500 * time.Millisecond
		if sc.Millis > 0 {
			took = time.Duration(sc.Millis) * time.Millisecond
		}
		select {
		case <-time.After(took):
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	if err == nil {
		s.mu.Lock()
		s.done[ev.ID] = true
		s.mu.Unlock()
	}
	return err
}

func (s *scripted) deliveries(id int64) []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]uint64(nil), s.seen[id]...)
}

func (s *scripted) handled() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.done)
}

func (s *scripted) isDone(id int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done[id]
}

func testEvent(behave string, fails int) outbox.Event {
	return outbox.Event{AggregateType: "test", AggregateID: "1", Type: "test.event", Payload: script{Behave: behave, Fails: fails}}
}

func write(env *subscribertest.Env, events ...outbox.Event) []int64 {
	return env.Write(func(pgx.Tx) ([]outbox.Event, error) { return events, nil })
}

func TestOutcomes(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	h := newScripted("outcomes")
	env.StartRunner(each(h), nil)
	ids := write(env,
		testEvent("fail", 2),      // nak twice, then ack
		testEvent("retry", 0),     // RetryAfter 700ms, then ack
		testEvent("fail", 99),     // fails every time: dead letter after max_failures (5)
		testEvent("permanent", 0), // dead letter at once
		testEvent("ok", 0),        // behind the others, and not held up by them
	)
	subscribertest.WaitFor(t, 15*time.Second, "the ok event", func() (bool, string) { return h.isDone(ids[4]), "" })
	subscribertest.WaitFor(t, 20*time.Second, "two dead letters", func() (bool, string) {
		return len(env.DeadLetters(h.name)) == 2, strconv.Itoa(len(env.DeadLetters(h.name)))
	})
	env.WaitIdle(h.name, 10*time.Second)

	if d := h.deliveries(ids[0]); len(d) != 3 || !h.isDone(ids[0]) {
		t.Errorf("fail-twice event: deliveries %v, done %v; want 3 deliveries and done", d, h.isDone(ids[0]))
	}
	h.mu.Lock()
	at := h.at[ids[0]]
	retryAt := h.at[ids[1]]
	h.mu.Unlock()
	// retry_min is 100ms: the naks wait 100ms, then 200ms.
	if gap1, gap2 := at[1].Sub(at[0]), at[2].Sub(at[1]); gap1 < 90*time.Millisecond || gap2 < 190*time.Millisecond {
		t.Errorf("nak delays %s then %s, want about 100ms then 200ms (doubling)", gap1, gap2)
	}
	if len(retryAt) != 2 || retryAt[1].Sub(retryAt[0]) < 650*time.Millisecond {
		t.Errorf("RetryAfter(700ms): deliveries at %v, want 2, 700ms apart", retryAt)
	}
	if d := h.deliveries(ids[2]); len(d) != 5 {
		t.Errorf("always-failing event handled %d times, want max_failures = 5", len(d))
	}
	if d := h.deliveries(ids[3]); len(d) != 1 {
		t.Errorf("permanent failure delivered %d times, want 1", len(d))
	}
	reasons := map[string]string{}
	for _, m := range env.DeadLetters(h.name) {
		reasons[m.Header.Get(wire.EventIDHeader)] = m.Header.Get(subscribers.DeadReasonHeader) + " / deliveries " + m.Header.Get(subscribers.DeadDeliveriesHeader)
	}
	if r := reasons[strconv.FormatInt(ids[2], 10)]; !strings.Contains(r, "gave up after 5 failures (subscribers.max_failures): transient trouble") || !strings.HasSuffix(r, "deliveries 5") {
		t.Errorf("exhausted event's dead letter: %q", r)
	}
	if r := reasons[strconv.FormatInt(ids[3], 10)]; !strings.Contains(r, "this event is nonsense") {
		t.Errorf("permanent event's dead letter: %q", r)
	}
	for _, id := range []int64{ids[0], ids[1], ids[4]} {
		if !env.Checkpointed(h.name, id) {
			t.Errorf("event %d not checkpointed", id)
		}
	}
}

// A handler that never returns is cut off by subscribers.handler_timeout;
// after max_failures such attempts the event is in the dead letters.
func TestHungHandlerIsCutOffAndDeadLettered(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.MaxFailures = 2
	env.Config.Subscribers.HandlerTimeout = 300 * time.Millisecond
	h := newScripted("hung")
	env.StartRunner(each(h), nil)
	id := write(env, testEvent("hang", 0))[0]
	subscribertest.WaitFor(t, 15*time.Second, "the dead letter", func() (bool, string) {
		return len(env.DeadLetters(h.name)) == 1, strconv.Itoa(len(h.deliveries(id))) + " deliveries"
	})
	if r := env.DeadLetters(h.name)[0].Header.Get(subscribers.DeadReasonHeader); !strings.Contains(r, "gave up after 2 failures (subscribers.max_failures): handler did not finish within subscribers.handler_timeout (300ms): context deadline exceeded") {
		t.Errorf("reason %q", r)
	}
}

// An event whose handling kills its process every time (a crash loop):
// each attempt ends with no outcome at all. With max_crashes 2 it is tried
// three times (the first attempt was not yet known to be dangerous: it ran
// in a batch of first deliveries, unrecorded), then dead-lettered on
// arrival, so it neither loops forever nor vanishes.
func TestCrashLoopEventEndsInDeadLetters(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.MaxCrashes = 2
	var id int64
	crashes := 0
	for crashes < 3 && len(env.DeadLetters("crashloop")) == 0 {
		h := newScripted("crashloop")
		r := env.StartRunner(each(h), nil)
		if id == 0 {
			id = write(env, testEvent("hang", 0))[0]
		}
		subscribertest.WaitFor(t, 10*time.Second, "a delivery", func() (bool, string) { return len(h.deliveries(id)) == 1, "" })
		subscribers.Crash(r) // the process dies mid-handling
		crashes++
	}
	survivor := newScripted("crashloop")
	env.StartRunner(each(survivor), nil)
	subscribertest.WaitFor(t, 15*time.Second, "the dead letter", func() (bool, string) { return len(env.DeadLetters("crashloop")) == 1, "" })
	if r := env.DeadLetters("crashloop")[0].Header.Get(subscribers.DeadReasonHeader); !strings.Contains(r, "its handling never ended 2 times") {
		t.Errorf("reason %q", r)
	}
	if crashes != 3 || len(survivor.deliveries(id)) != 0 {
		t.Errorf("the handler ran %d times before the dead letter and %d times after; want 3 and 0", crashes, len(survivor.deliveries(id)))
	}
	env.WaitIdle("crashloop", 10*time.Second)
}

// The events in flight beside a crash-looping one die with it every time
// until it is isolated; they are handled, once, and never dead-lettered.
func TestCrashLoopSparesItsBatchMates(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.MaxCrashes = 2
	env.Config.Subscribers.Concurrency = 1
	events := []outbox.Event{testEvent("ok", 0), testEvent("ok", 0), testEvent("hang", 0), testEvent("ok", 0), testEvent("ok", 0)}
	ids := write(env, events...)
	poison := ids[2]
	// The process dies whenever the poison is in hand; once the poison is
	// dead-lettered, the last instance runs on undisturbed.
	for restart := 0; restart < 10; restart++ {
		h := newScripted("mates")
		r := env.StartRunner(each(h), nil)
		subscribertest.WaitFor(t, 15*time.Second, "the poison or the dead letter", func() (bool, string) {
			return len(h.deliveries(poison)) > 0 || len(env.DeadLetters("mates")) > 0, ""
		})
		if len(h.deliveries(poison)) == 0 {
			break
		}
		subscribers.Crash(r)
	}
	env.WaitIdle("mates", 15*time.Second)
	dead := env.DeadLetters("mates")
	if len(dead) != 1 || dead[0].Header.Get(wire.EventIDHeader) != strconv.FormatInt(poison, 10) {
		t.Fatalf("%d dead letters, want exactly the poison event %d", len(dead), poison)
	}
	for _, id := range ids {
		if id != poison && !env.Checkpointed("mates", id) {
			t.Errorf("batch-mate %d was never handled", id)
		}
	}
}

// Long work sends in-progress signals: a handler taking 2.5 ack waits is
// not redelivered meanwhile. The ack wait is 2 s here (1 s elsewhere): an
// in-progress signal goes every third of it, and a stall of two thirds of
// it on a loaded machine must not pass for a missing keep-alive.
func TestLongWorkIsKeptAlive(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.AckWait = 2 * time.Second
	h := newScripted("slow")
	env.StartRunner(each(h), nil)
	id := write(env, outbox.Event{AggregateType: "test", AggregateID: "1", Type: "test.event", Payload: script{Behave: "slow", Millis: 5000}})[0]
	subscribertest.WaitFor(t, 20*time.Second, "the slow event", func() (bool, string) { return h.isDone(id), "" })
	env.WaitIdle(h.name, 15*time.Second)
	if d := h.deliveries(id); len(d) != 1 {
		t.Errorf("slow event delivered %d times, want 1 (in-progress must hold it)", len(d))
	}
}

// SIGTERM semantics: Stop lets the event in hand finish and be acked.
func TestStopDrainsEventsInHand(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	h := newScripted("drain")
	r := env.StartRunner(each(h), nil)
	id := write(env, testEvent("slow", 0))[0]
	subscribertest.WaitFor(t, 15*time.Second, "the slow event to start", func() (bool, string) { return len(h.deliveries(id)) == 1, "" })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if !h.isDone(id) || !env.Checkpointed(h.name, id) {
		t.Fatalf("after Stop: done %v, checkpointed %v; want the event in hand finished", h.isDone(id), env.Checkpointed(h.name, id))
	}
	if _, ackPending, err := env.ConsumerState(h.name); err != nil || ackPending != 0 {
		t.Errorf("ack pending %d after a drain (%v), want 0", ackPending, err)
	}
}

// Two instances share one durable consumer: every event is handled once in
// all, and both do some of the work.
func TestInstancesShareTheConsumer(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.BatchSize = 5
	a, b := newScripted("shared"), newScripted("shared")
	env.StartRunner(each(a), nil)
	env.StartRunner(each(b), nil)
	var ids []int64
	for range 40 {
		ids = append(ids, write(env, testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0))...)
		time.Sleep(5 * time.Millisecond)
	}
	env.WaitSent(ids...)
	env.WaitIdle("shared", 15*time.Second)
	for _, id := range ids {
		if n := len(a.deliveries(id)) + len(b.deliveries(id)); n != 1 {
			t.Fatalf("event %d handled %d times by the two instances", id, n)
		}
	}
	t.Logf("instance a handled %d, b %d", a.handled(), b.handled())
	if a.handled() == 0 || b.handled() == 0 {
		t.Errorf("instance a handled %d events, b %d: both should share the work", a.handled(), b.handled())
	}
}

// A subscriber stopped for a while catches up on what it missed.
func TestStoppedSubscriberCatchesUp(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	first := newScripted("catchup")
	r := env.StartRunner(each(first), nil)
	before := write(env, testEvent("ok", 0))
	subscribertest.WaitFor(t, 15*time.Second, "the first event", func() (bool, string) { return first.isDone(before[0]), "" })
	if err := r.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	var missed []int64
	for range 10 {
		missed = append(missed, write(env, testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0))...)
	}
	later := newScripted("catchup")
	env.StartRunner(each(later), nil)
	env.WaitSent(missed...)
	env.WaitIdle("catchup", 10*time.Second)
	for _, id := range missed {
		if !later.isDone(id) {
			t.Errorf("event %d written while the subscriber was down never arrived", id)
		}
	}
	if len(later.deliveries(before[0])) != 0 {
		t.Error("the restarted subscriber got an event it had already acked")
	}
}

// Adding a subscriber changes no writer: a new one, on a stream that already
// holds events, replays the history (start all) or sees only new events
// (start new), and the existing subscriber is unaffected.
func TestAddingASubscriber(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	existing := newScripted("existing")
	env.StartRunner(each(existing), nil)
	history := write(env, testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0))
	env.WaitSent(history...)
	env.WaitIdle("existing", 10*time.Second)

	replaying := newScripted("audit-all")
	env.StartRunner(each(replaying), nil) // subscribers.start = all (the default)
	onlyNew := newScripted("audit-new")
	env.StartRunner(each(onlyNew), func(o *subscribers.Options) { o.Config.Start = "new" })
	env.WaitIdle("audit-all", 10*time.Second)

	fresh := write(env, testEvent("ok", 0))
	env.WaitSent(fresh...)
	for _, name := range []string{"existing", "audit-all", "audit-new"} {
		env.WaitIdle(name, 10*time.Second)
	}
	for _, id := range append(history, fresh...) {
		if !replaying.isDone(id) {
			t.Errorf("start=all subscriber missed event %d", id)
		}
		if n := len(existing.deliveries(id)); n != 1 {
			t.Errorf("existing subscriber handled event %d %d times, want 1", id, n)
		}
	}
	for _, id := range history {
		if len(onlyNew.deliveries(id)) != 0 {
			t.Errorf("start=new subscriber got historical event %d", id)
		}
	}
	if !onlyNew.isDone(fresh[0]) {
		t.Error("start=new subscriber missed the new event")
	}
}

func TestConsumerConfiguration(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	h := newScripted("configured", "test.a", "test.b.>")
	env.StartRunner(each(newScripted("provisions-the-dead-letter-stream")), nil)

	verify := env.NewRunner(each(h), func(o *subscribers.Options) { o.Stream.Provision = "verify" })
	if err := verify.Start(context.Background()); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("verify with no consumer: %v", err)
	}
	env.StartRunner(each(h), nil)
	ctx := context.Background()
	c, err := env.JS.Consumer(ctx, env.Config.Stream.Name, "configured")
	if err != nil {
		t.Fatal(err)
	}
	cc := c.CachedInfo().Config
	if cc.AckPolicy != jetstream.AckExplicitPolicy || cc.AckWait != time.Second || cc.MaxDeliver != -1 ||
		cc.MaxAckPending != env.Config.Subscribers.MaxAckPending || cc.Description == "" ||
		strings.Join(cc.FilterSubjects, ",") != "events.test.a,events.test.b.>" || cc.Durable != "configured" {
		t.Errorf("consumer config: %+v", cc)
	}
	// Another instance with verify binds to it.
	env.StartRunner(each(newScripted("configured", "test.a", "test.b.>")), func(o *subscribers.Options) { o.Stream.Provision = "verify" })
}

func TestCheckpointPrune(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Stream.MaxAge = time.Hour
	r := env.NewRunner(each(newScripted("pruned")), nil)
	ctx := context.Background()
	_, err := env.DB.Pool.Exec(ctx, `
INSERT INTO processed_events (subscriber, event_id, processed_at)
SELECT 'pruned', g, CASE WHEN g <= 7000 THEN now() - interval '2 hours' ELSE now() END FROM generate_series(1, 7010) g
UNION ALL SELECT 'other', 1, now() - interval '2 hours'`)
	if err != nil {
		t.Fatal(err)
	}
	n, err := r.Prune(ctx)
	if err != nil || n != 7000 {
		t.Fatalf("pruned %d rows (%v), want the 7000 older than the stream's max age", n, err)
	}
	counts, _ := bookkeeping.New(env.DB.Pool).CheckpointCount(ctx)
	if left, other := counts["pruned"], counts["other"]; left != 10 || other != 1 {
		t.Errorf("left %d of ours and %d of another subscriber's; want 10 and 1", left, other)
	}
}

// A subscriber started before the relay created the stream waits for it.
func TestSubscriberWaitsForTheStream(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Stream.Name = "LATER"
	env.Config.Stream.SubjectPrefix = "later"
	h := newScripted("early")
	r := env.NewRunner(each(h), nil)
	started := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		started <- r.Start(ctx)
	}()
	t.Cleanup(func() { _ = r.Stop(context.Background()) })
	select {
	case err := <-started:
		t.Fatalf("Start returned (%v) with no stream to consume", err)
	case <-time.After(500 * time.Millisecond):
	}
	cfg := env.Config.Stream
	if _, err := env.JS.CreateStream(context.Background(), jetstream.StreamConfig{Name: cfg.Name, Subjects: []string{cfg.SubjectPrefix + ".>"}, Duplicates: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if err := <-started; err != nil {
		t.Fatalf("Start after the stream appeared: %v", err)
	}
}

// traceRecorder remembers the trace id each event was handled under.
type traceRecorder struct {
	*scripted
	mu     sync.Mutex
	traces map[int64]trace.TraceID
}

func (r *traceRecorder) Handle(ctx context.Context, ev subscribers.Event) error {
	r.mu.Lock()
	r.traces[ev.ID] = trace.SpanContextFromContext(ctx).TraceID()
	r.mu.Unlock()
	return r.scripted.Handle(ctx, ev)
}

// A writer's trace (its span in ctx) travels in the outbox row's headers, in
// the NATS message's traceparent, and into the subscriber's handling.
func TestTraceContextReachesTheHandler(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	h := &traceRecorder{scripted: newScripted("traced"), traces: map[int64]trace.TraceID{}}
	env.StartRunner(each(h), nil)
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled, Remote: true}))
	var id int64
	err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		var err error
		id, err = outbox.Write(ctx, tx, testEvent("ok", 0))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var stored string
	if err := env.DB.Pool.QueryRow(ctx, `SELECT headers->>'traceparent' FROM outbox WHERE id = $1`, id).Scan(&stored); err != nil ||
		!strings.Contains(stored, "4bf92f3577b34da6a3ce929d0e0e4736") {
		t.Fatalf("outbox headers traceparent %q (%v)", stored, err)
	}
	subscribertest.WaitFor(t, 10*time.Second, "the traced event", func() (bool, string) { return h.isDone(id), "" })
	h.mu.Lock()
	defer h.mu.Unlock()
	if got := h.traces[id]; got != traceID {
		t.Errorf("handler ran under trace %s, want the writer's %s", got, traceID)
	}
}

// bothKinds implements HandleTx and Handle: which path its effects take
// is the constructor's choice, never a guess.
type bothKinds struct{ *scripted }

func (bothKinds) HandleTx(context.Context, pgx.Tx, subscribers.Event) error { return nil }

func TestTheHandlerKindIsTheConstructors(t *testing.T) {
	both := bothKinds{newScripted("both")}
	if _, ok := subscribers.Tx(both).EventHandler(); ok {
		t.Error("a handler made by Tx also runs as an EventHandler")
	}
	if _, ok := subscribers.Each(both).TxHandler(); ok {
		t.Error("a handler made by Each also runs as a TxHandler")
	}
	_, err := subscribers.New(subscribers.Options{Logger: slog.Default()})
	if err == nil || !strings.Contains(err.Error(), "subscribers.Tx or subscribers.Each") {
		t.Fatalf("New without a handler: %v", err)
	}
}

// subscribers.start=new is for a new subscriber: one that has checkpoints
// and finds its consumer gone (deleted by hand, or lost with a JetStream
// store rolled back) gets a consumer from the stream's first event, and
// misses none of the events published while it had none.
func TestStartNewAppliesToANewSubscriberOnly(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	history := write(env, testEvent("ok", 0), testEvent("ok", 0))
	env.WaitSent(history...)
	startNew := func(o *subscribers.Options) { o.Config.Start = "new" }
	first := newScripted("late")
	r := env.StartRunner(each(first), startNew)
	seen := write(env, testEvent("ok", 0))
	env.WaitSent(seen...)
	env.WaitIdle("late", 10*time.Second)
	if !first.isDone(seen[0]) || len(first.deliveries(history[0])) != 0 {
		t.Fatalf("start=new: new event handled %t, historical one delivered %d times", first.isDone(seen[0]), len(first.deliveries(history[0])))
	}
	if err := r.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := env.JS.DeleteConsumer(context.Background(), env.Config.Stream.Name, "late"); err != nil {
		t.Fatal(err)
	}
	gone := write(env, testEvent("ok", 0), testEvent("ok", 0))
	env.WaitSent(gone...)
	again := newScripted("late")
	env.StartRunner(each(again), startNew)
	more := write(env, testEvent("ok", 0))
	env.WaitSent(more...)
	env.WaitIdle("late", 10*time.Second)
	for _, id := range append(gone, more...) {
		if !again.isDone(id) {
			t.Errorf("event %d, published while the consumer was gone or after, not handled", id)
		}
	}
	if len(again.deliveries(seen[0])) != 0 {
		t.Errorf("event %d, checkpointed before, handled again", seen[0])
	}
}
