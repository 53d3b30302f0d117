package subscribers_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// txScripted is scripted as a TxHandler: its effect would be in Postgres.
// It holds the script rather than embedding it, so it is not also an
// EventHandler (the runtime refuses a handler of both kinds).
type txScripted struct{ scripted *scripted }

// declared declares s: its script's subscriber, made by Tx.
func (s txScripted) declared() subscribers.Declaration {
	return subscribertest.Declare(s.scripted.name, subscribers.Tx(s), s.scripted.types...)
}

func (s txScripted) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		return err
	}
	return s.scripted.Handle(ctx, ev)
}

// An outage of Postgres (the checkpoint store) longer than many ack waits,
// with a backlog in hand and max_failures at 2: the subscriber holds its
// events and takes no new ones, readiness names Postgres, nothing is
// dead-lettered, and once Postgres is back everything is handled. (It used
// to nak every delivery with the checkpoint unreadable, and JetStream's
// delivery limit dead-lettered the backlog: 487 events after 25 s.)
func TestPostgresOutageDeadLettersNothing(t *testing.T) {
	for _, kind := range []string{"event handler", "tx handler"} {
		t.Run(strings.ReplaceAll(kind, " ", "_"), func(t *testing.T) {
			t.Parallel()
			env := subscribertest.NewEnv(t)
			env.Config.Subscribers.MaxFailures = 2
			env.Config.Subscribers.BatchSize = 20
			name := "pgdown-" + strings.ReplaceAll(kind, " ", "-")
			sc := newScripted(name)
			d := each(sc)
			if kind == "tx handler" {
				d = txScripted{sc}.declared()
			}
			pool, proxy := env.ProxiedPool()
			r := env.StartRunner(d, func(o *subscribers.Options) { o.Pool = pool })

			proxy.Cut()
			var ids []int64
			for range 10 {
				ids = append(ids, write(env, testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0), testEvent("ok", 0))...)
			}
			env.WaitSent(ids...)
			subscribertest.WaitFor(t, 10*time.Second, "readiness to name postgres", func() (bool, string) {
				err := r.Ready()
				return err != nil && strings.Contains(err.Error(), "postgres"), "ready: " + errString(err)
			})
			// Several ack waits (1 s here) and what used to be the whole
			// delivery budget, many times over.
			time.Sleep(6 * time.Second)
			if n := len(env.DeadLetters(name)); n != 0 {
				t.Fatalf("%d dead letters during a Postgres outage, want 0", n)
			}
			proxy.Restore()
			env.WaitIdle(name, 30*time.Second)
			if n := len(env.DeadLetters(name)); n != 0 {
				t.Errorf("%d dead letters after a Postgres outage, want 0", n)
			}
			for _, id := range ids {
				if !env.Checkpointed(name, id) {
					t.Fatalf("event %d not handled after the outage", id)
				}
			}
			if err := r.Ready(); err != nil {
				t.Errorf("still not ready after the outage: %v", err)
			}
		})
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

// flaky is a dependency the test switches off and on.
type flaky struct {
	*scripted
	down   atomic.Bool
	blame  bool // fail with Unavailable (else a plain error: the probe must tell)
	probes atomic.Int64
	calls  atomic.Int64
}

func (f *flaky) Dependencies() []subscribers.Dependency {
	return []subscribers.Dependency{{Name: "thing", Probe: func(context.Context) error {
		f.probes.Add(1)
		if f.down.Load() {
			return errors.New("thing refuses connections")
		}
		return nil
	}}}
}

func (f *flaky) Handle(ctx context.Context, ev subscribers.Event) error {
	f.calls.Add(1)
	if f.down.Load() {
		if f.blame {
			return subscribers.Unavailable("thing", errors.New("thing refuses connections"))
		}
		return errors.New("write failed")
	}
	return f.scripted.Handle(ctx, ev)
}

// A dependency the handler declares goes down: whether the handler says so
// (Unavailable) or only fails (and the probe tells), no failure is counted
// (max_failures is 1), the handler is not hammered, readiness names the
// dependency, and everything is handled once it is back.
func TestHandlerDependencyOutage(t *testing.T) {
	for _, blame := range []bool{true, false} {
		t.Run("unavailable_"+strconv.FormatBool(blame), func(t *testing.T) {
			t.Parallel()
			env := subscribertest.NewEnv(t)
			env.Config.Subscribers.MaxFailures = 1
			name := "thing-" + strconv.FormatBool(blame)
			h := &flaky{scripted: newScripted(name), blame: blame}
			r := env.StartRunner(each(h), nil)
			h.down.Store(true)
			var ids []int64
			for range 20 {
				ids = append(ids, write(env, testEvent("ok", 0), testEvent("ok", 0))...)
			}
			env.WaitSent(ids...)
			subscribertest.WaitFor(t, 10*time.Second, "readiness to name the dependency", func() (bool, string) {
				err := r.Ready()
				return err != nil && strings.Contains(err.Error(), "thing"), errString(err)
			})
			callsAt := h.calls.Load()
			time.Sleep(4 * time.Second)
			// Held, not retried in a loop: the probe decides when to try.
			if extra := h.calls.Load() - callsAt; extra > 0 {
				t.Errorf("the handler was called %d times while its dependency was down and the probe said so", extra)
			}
			if h.probes.Load() < 3 {
				t.Errorf("the dependency was probed %d times in 4 s of outage", h.probes.Load())
			}
			if n := len(env.DeadLetters(name)); n != 0 {
				t.Fatalf("%d dead letters during the outage, want 0", n)
			}
			h.down.Store(false)
			env.WaitIdle(name, 30*time.Second)
			for _, id := range ids {
				if !h.isDone(id) {
					t.Fatalf("event %d never handled", id)
				}
			}
			if n := len(env.DeadLetters(name)); n != 0 {
				t.Errorf("%d dead letters, want 0", n)
			}
		})
	}
}

// A poison event reaches its verdict while the dead-letter stream cannot
// take it (its subjects moved away): the event is neither termed nor acked
// (not even when its instance restarts meanwhile); once the stream takes
// dead letters again, it is there with its reason. (It used to be lost: the
// runtime gave up publishing and JetStream dropped it at max_deliver.)
func TestDeadLetterStreamUnavailableLosesNothing(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.MaxFailures = 2
	name := "dlq-down"
	first := env.StartRunner(each(newScripted(name)), nil)
	ctx := context.Background()
	dl, err := env.JS.Stream(ctx, env.Config.Subscribers.DeadLetterStream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := dl.CachedInfo().Config
	parked := cfg
	parked.Subjects = []string{"parked.>"}
	if _, err := env.JS.UpdateStream(ctx, parked); err != nil {
		t.Fatal(err)
	}
	poison := write(env, testEvent("permanent", 0), testEvent("fail", 99))
	env.WaitSent(poison...)
	subscribertest.WaitFor(t, 15*time.Second, "readiness to name the dead letters", func() (bool, string) {
		err := first.Ready()
		return err != nil && strings.Contains(err.Error(), "deadletter"), errString(err)
	})
	// A restart while the dead letters are held: they are not lost either.
	if err := first.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	// (Dead-letter provisioning verify, as in production: with auto, a
	// starting instance re-applies the dead-letter stream's configuration,
	// which would end this outage.)
	second := newScripted(name)
	env.StartRunner(each(second), func(o *subscribers.Options) { o.Config.DeadLetterProvision = "verify" })
	time.Sleep(3 * time.Second)
	_, ackPending, err := env.ConsumerState(name)
	if err != nil || ackPending != 2 {
		t.Fatalf("ack pending %d (%v) while the dead letters cannot be stored, want the 2 events still pending", ackPending, err)
	}
	if _, err := env.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, 30*time.Second, "both dead letters", func() (bool, string) {
		n := len(env.DeadLetters(name))
		return n == 2, strconv.Itoa(n)
	})
	env.WaitIdle(name, 15*time.Second)
	reasons := map[string]string{}
	for _, m := range env.DeadLetters(name) {
		reasons[m.Header.Get(wire.EventIDHeader)] = m.Header.Get(subscribers.DeadReasonHeader)
	}
	if r := reasons[strconv.FormatInt(poison[0], 10)]; !strings.Contains(r, "this event is nonsense") {
		t.Errorf("permanent event's reason %q", r)
	}
	if r := reasons[strconv.FormatInt(poison[1], 10)]; !strings.Contains(r, "gave up after 2 failures") {
		t.Errorf("failing event's reason %q", r)
	}
}

// An event whose effect committed with its checkpoint is never
// dead-lettered, however its acks are lost: with max_crashes 1, a crash
// after the commit and before the ack of a redelivered event still ends
// with the event acked and handled once.
func TestCheckpointedEventIsNeverDeadLettered(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.MaxCrashes = 1
	name := "committed"
	sc := newScripted(name)
	var once sync.Once
	crashNow := make(chan struct{})
	r := env.NewRunner(txScripted{sc}.declared(), nil)
	env.StartHooked(r, testhooks.Subscriber{BeforeAck: func(ctx context.Context, ids []int64) {
		once.Do(func() { close(crashNow) })
		<-ctx.Done()
	}})
	id := write(env, testEvent("fail", 1))[0] // fails once, then commits
	select {
	case <-crashNow:
	case <-time.After(20 * time.Second):
		t.Fatal("the event never committed")
	}
	subscribers.Crash(r)
	if !env.Checkpointed(name, id) {
		t.Fatal("the redelivered event did not commit before the crash")
	}
	after := newScripted(name)
	env.StartRunner(txScripted{after}.declared(), nil)
	env.WaitIdle(name, 20*time.Second)
	if n := len(env.DeadLetters(name)); n != 0 {
		t.Errorf("%d dead letters for an event in the checkpoint", n)
	}
	if n := len(after.deliveries(id)); n != 0 {
		t.Errorf("the handler ran %d more times on a checkpointed event", n)
	}
}

// Events held through an outage are kept alive with in-progress signals:
// a second instance does not get them meanwhile.
func TestHeldEventsAreNotRedelivered(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	name := "held"
	holder := &flaky{scripted: newScripted(name), blame: true}
	holder.down.Store(true)
	env.StartRunner(each(holder), nil)
	id := write(env, testEvent("ok", 0))[0]
	subscribertest.WaitFor(t, 10*time.Second, "the event in hand", func() (bool, string) { return holder.calls.Load() > 0, "" })
	other := newScripted(name)
	env.StartRunner(each(other), func(o *subscribers.Options) { o.Config.Concurrency = 1 })
	time.Sleep(4 * time.Second) // four ack waits
	if n := len(other.deliveries(id)); n != 0 {
		t.Fatalf("the held event was redelivered to another instance %d times", n)
	}
	holder.down.Store(false)
	env.WaitIdle(name, 20*time.Second)
	if !env.Checkpointed(name, id) {
		t.Error("the held event was never handled")
	}
}

// undeclared fails with Unavailable naming a dependency it never declared
// (so there is no probe): the runtime retries after a backoff, and once the
// handler works again the dependency counts as back.
type undeclared struct {
	*scripted
	down atomic.Bool
}

func (u *undeclared) Handle(ctx context.Context, ev subscribers.Event) error {
	if u.down.Load() {
		return subscribers.Unavailable("mystery", errors.New("no answer"))
	}
	return u.scripted.Handle(ctx, ev)
}

func TestUndeclaredDependencyOutage(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.MaxFailures = 1
	h := &undeclared{scripted: newScripted("mystery")}
	h.down.Store(true)
	r := env.StartRunner(each(h), nil)
	ids := write(env, testEvent("ok", 0), testEvent("ok", 0))
	subscribertest.WaitFor(t, 10*time.Second, "readiness to name the dependency", func() (bool, string) {
		err := r.Ready()
		return err != nil && strings.Contains(err.Error(), "mystery"), errString(err)
	})
	time.Sleep(2 * time.Second)
	h.down.Store(false)
	env.WaitIdle("mystery", 20*time.Second)
	for _, id := range ids {
		if !h.isDone(id) {
			t.Fatalf("event %d never handled", id)
		}
	}
	if n := len(env.DeadLetters("mystery")); n != 0 {
		t.Errorf("%d dead letters, want 0", n)
	}
	if err := r.Ready(); err != nil {
		t.Errorf("not ready after the handler works again: %v", err)
	}
}

// stepped fails its first call on an event, then blocks each call until the
// test releases it and fails it, until told to succeed.
type stepped struct {
	*scripted
	calls   atomic.Int64
	entered chan int64
	release chan error
}

func (s *stepped) Handle(ctx context.Context, ev subscribers.Event) error {
	n := s.calls.Add(1)
	if n == 1 {
		return errors.New("first try fails")
	}
	s.entered <- n
	if err := <-s.release; err != nil {
		return err
	}
	return s.scripted.Handle(ctx, ev)
}

// A redelivered event in hand when Postgres goes away, twice: its attempt
// cannot be closed while Postgres is gone, and stays open; this process
// knows the open attempt is its own and does not take it for a crash (with
// max_crashes 2, two such outages would otherwise dead-letter the event).
func TestOwnOpenAttemptIsNotACrash(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	env.Config.Subscribers.MaxCrashes = 2
	h := &stepped{scripted: newScripted("own"), entered: make(chan int64), release: make(chan error)}
	pool, proxy := env.ProxiedPool()
	r := env.StartRunner(each(h), func(o *subscribers.Options) { o.Pool = pool })
	id := write(env, testEvent("ok", 0))[0]
	for range 2 {
		select {
		case <-h.entered: // the redelivery, its attempt open
		case <-time.After(20 * time.Second):
			t.Fatal("the event never came back")
		}
		proxy.Cut()
		h.release <- errors.New("the write failed with the network")
		subscribertest.WaitFor(t, 10*time.Second, "readiness to name postgres", func() (bool, string) {
			err := r.Ready()
			return err != nil && strings.Contains(err.Error(), "postgres"), errString(err)
		})
		proxy.Restore()
	}
	select {
	case <-h.entered:
		h.release <- nil
	case <-time.After(20 * time.Second):
		t.Fatal("the event was not tried after the second outage")
	}
	env.WaitIdle("own", 20*time.Second)
	if n := len(env.DeadLetters("own")); n != 0 {
		t.Fatalf("%d dead letters: the runtime took its own open attempt for a crash", n)
	}
	if !h.isDone(id) || !env.Checkpointed("own", id) {
		t.Error("the event was not handled")
	}
}

// A subscriber whose Postgres role lacks a grant on its tables is a
// configuration error, refused at start with what to do; it is not an
// outage to wait out forever.
func TestMissingGrantIsRefusedAtStart(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx := context.Background()
	role := "fanout_test_nogrant_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	if _, err := env.DB.Pool.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = env.DB.Pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = env.DB.Pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	if _, err := env.DB.Pool.Exec(ctx, `GRANT SELECT, INSERT, DELETE ON processed_events TO `+role); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(env.DB.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SET ROLE `+role)
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	r := env.NewRunner(each(newScripted("nogrant")), func(o *subscribers.Options) { o.Pool = pool })
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err = r.Start(sctx)
	if err == nil {
		_ = r.Stop(ctx)
		t.Fatal("started without a grant on subscriber_attempts")
	}
	if !strings.Contains(err.Error(), "subscriber_attempts") || !strings.Contains(err.Error(), "roles.sql") {
		t.Errorf("start error %q does not say what is missing and what to do", err)
	}
}

// An idle subscriber notices an outage too: its dependencies are probed
// in the background, so readiness follows Postgres with no event to find
// it, and comes back with it.
func TestIdleSubscriberReadinessFollowsPostgres(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	pool, proxy := env.ProxiedPool()
	r := env.StartRunner(each(newScripted("idle")), func(o *subscribers.Options) { o.Pool = pool })
	if err := r.Ready(); err != nil {
		t.Fatalf("a fresh subscriber is not ready: %v", err)
	}
	proxy.Cut()
	subscribertest.WaitFor(t, 20*time.Second, "readiness to name postgres", func() (bool, string) {
		err := r.Ready()
		return err != nil && strings.Contains(err.Error(), "postgres"), errString(err)
	})
	proxy.Restore()
	subscribertest.WaitFor(t, 20*time.Second, "readiness to come back", func() (bool, string) {
		err := r.Ready()
		return err == nil, errString(err)
	})
}
