// Package subscribertest is the test kit of subscribers: Env, a real
// Postgres database, nats-server and relay for one test, and Run, the
// conformance suite every subscriber package runs (idempotent under
// redelivery, permanent errors reach the dead letters with their reason, a
// cancelled context stops work, a duplicate event id has no second effect).
package subscribertest

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/faultproxy"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Env is one test's pipeline: a database, a nats-server, and a relay
// publishing the database's outbox.
type Env struct {
	T      *testing.T
	DB     *pgtest.DB
	NATS   *natstest.Server
	Conn   *nats.Conn
	JS     jetstream.JetStream
	Config *Config
	Logger *slog.Logger
}

// Config is the settings a test's pipeline runs with: the sections of the
// relay, the stream and the subscriber runtime.
type Config struct {
	Stream      stream.Config
	Relay       relay.Config
	Subscribers subscribers.Config
}

// DefaultConfig is each package's defaults.
func DefaultConfig() *Config {
	return &Config{Stream: stream.DefaultConfig(), Relay: relay.DefaultConfig(), Subscribers: subscribers.DefaultConfig()}
}

// NewEnv starts the test's services and a relay. Its subscriber settings
// are quick: a 1 s ack wait, retries from 100 ms, 5 deliveries.
func NewEnv(t *testing.T) *Env {
	t.Helper()
	return NewEnvWith(t, nil)
}

// NewEnvWith is NewEnv with its settings adjusted by adjust (if not nil)
// before the relay starts.
func NewEnvWith(t *testing.T, adjust func(*Config)) *Env {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Relay.PollInterval = 50 * time.Millisecond
	cfg.Subscribers.AckWait = time.Second
	cfg.Subscribers.RetryMin = 100 * time.Millisecond
	cfg.Subscribers.RetryMax = time.Second
	cfg.Subscribers.MaxFailures = 5
	cfg.Subscribers.BatchSize = 50
	cfg.Subscribers.Concurrency = 2
	// An ordered subscriber's standby takes over 3 s after its pinned
	// instance stops pulling.
	cfg.Subscribers.PinnedTTL = 3 * time.Second
	if adjust != nil {
		adjust(cfg)
	}
	e := &Env{T: t, DB: pgtest.NewDB(t), NATS: natstest.Start(t), Config: cfg, Logger: Logger(t)}
	e.Conn = e.Connect()
	var err error
	if e.JS, err = jetstream.New(e.Conn); err != nil {
		t.Fatal(err)
	}
	e.StartRelay(testhooks.Relay{})
	return e
}

// StartRelay starts one more relay on the env's database (NewEnv starts
// the first), with hooks, and stops it when the test ends.
func (e *Env) StartRelay(hooks testhooks.Relay) {
	e.T.Helper()
	r, err := relay.New(relay.Options{Relay: e.Config.Relay, Stream: e.Config.Stream, Pool: e.DB.Pool, Conn: e.Connect(),
		Logger: e.Logger.With("component", "relay")})
	if err != nil {
		e.T.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Start(testhooks.WithRelay(ctx, hooks)); err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Stop(ctx)
	})
}

// ProxiedPool returns a pool to the env's database through a proxy the
// test can cut: an outage of Postgres for whoever uses this pool (a runner
// under test), while the relay and the test's own pool keep working.
func (e *Env) ProxiedPool() (*pgxpool.Pool, *faultproxy.Proxy) {
	e.T.Helper()
	return ProxiedPool(e.T, e.DB.URL)
}

// ProxiedPool returns a pool to the database at dbURL through a fault
// proxy, to cut Postgres off from what uses the pool alone; both close
// when t ends.
func ProxiedPool(t testing.TB, dbURL string) (*pgxpool.Pool, *faultproxy.Proxy) {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	p, err := faultproxy.New(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	u.Host = p.Addr
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, p
}

// Logger logs to stderr under -v, else nowhere.
func Logger(t *testing.T) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// Connect returns a new connection to the test's server, closed at the
// end. Like a role's (internal/connect), it reconnects forever and keeps
// nothing to send while disconnected.
func (e *Env) Connect() *nats.Conn {
	e.T.Helper()
	nc, err := nats.Connect(e.NATS.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(nc.Close)
	return nc
}

// NewRunner returns a runner for the subscriber d declares, its handler
// built by d on the env's database, with the env's settings, adjusted by
// mutate; it is not started.
func (e *Env) NewRunner(d subscribers.Declaration, mutate func(*subscribers.Options)) *subscribers.Runner {
	e.T.Helper()
	h, err := d.Build(subscribers.Deps{Context: context.Background(), Pool: e.DB.Pool, Logger: e.Logger.With("component", d.Name)})
	if err != nil {
		e.T.Fatal(err)
	}
	opts := subscribers.Options{Declaration: d, Handler: h, Config: e.Config.Subscribers, Stream: e.Config.Stream,
		Pool: e.DB.Pool, Conn: e.Connect(), Logger: e.Logger.With("component", "subscriber")}
	if mutate != nil {
		mutate(&opts)
	}
	r, err := subscribers.New(opts)
	if err != nil {
		e.T.Fatal(err)
	}
	return r
}

// StartRunner starts a runner for the subscriber d declares and drains it
// when the test ends.
func (e *Env) StartRunner(d subscribers.Declaration, mutate func(*subscribers.Options)) *subscribers.Runner {
	e.T.Helper()
	r := e.NewRunner(d, mutate)
	e.Start(r)
	return r
}

// Start starts r and stops it when the test ends.
func (e *Env) Start(r *subscribers.Runner) {
	e.T.Helper()
	e.StartHooked(r, testhooks.Subscriber{})
}

// StartHooked starts r with test hooks (a moment to die at, say) and stops
// it when the test ends.
func (e *Env) StartHooked(r *subscribers.Runner, hooks testhooks.Subscriber) {
	e.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Start(testhooks.WithSubscriber(ctx, hooks)); err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Stop(ctx)
	})
}

// Write commits the events in one transaction, after fn (if any) wrote the
// business rows, and returns their ids.
func (e *Env) Write(fn func(tx pgx.Tx) ([]outbox.Event, error)) []int64 {
	e.T.Helper()
	ctx := context.Background()
	var ids []int64
	err := pgx.BeginFunc(ctx, e.DB.Pool, func(tx pgx.Tx) error {
		events, err := fn(tx)
		if err != nil {
			return err
		}
		for _, ev := range events {
			id, err := outbox.Write(ctx, tx, ev)
			if err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		e.T.Fatal(err)
	}
	return ids
}

// WaitFor polls cond until it holds or timeout passes.
func WaitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; last state: %s", timeout, what, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ConsumerState returns the subscriber's consumer's pending and ack-pending
// counts.
func (e *Env) ConsumerState(name string) (pending uint64, ackPending int, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := e.JS.Consumer(ctx, e.Config.Stream.Name, name)
	if err != nil {
		return 0, 0, err
	}
	info, err := c.Info(ctx)
	if err != nil {
		return 0, 0, err
	}
	return info.NumPending, info.NumAckPending, nil
}

// WaitIdle waits until the subscriber's consumer has nothing pending and
// nothing unacknowledged.
func (e *Env) WaitIdle(name string, timeout time.Duration) {
	e.T.Helper()
	WaitFor(e.T, timeout, name+" idle", func() (bool, string) {
		p, a, err := e.ConsumerState(name)
		if err != nil {
			return false, err.Error()
		}
		return p == 0 && a == 0, "pending " + strconv.FormatUint(p, 10) + ", ack pending " + strconv.Itoa(a)
	})
}

// Checkpointed reports whether the subscriber's checkpoint holds the event.
func (e *Env) Checkpointed(name string, id int64) bool {
	e.T.Helper()
	ok, err := bookkeeping.New(e.DB.Pool).CheckpointExists(context.Background(), bookkeeping.CheckpointKeyParams{Subscriber: name, EventID: id})
	if err != nil {
		e.T.Fatal(err)
	}
	return ok
}

// DeadLetters returns the subscriber's dead letters.
func (e *Env) DeadLetters(name string) []*jetstream.RawStreamMsg {
	e.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := e.JS.Stream(ctx, e.Config.Subscribers.DeadLetterStream)
	if err != nil {
		return nil // not created yet: no dead letters
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(e.Config.Subscribers.DeadLetterSubjectPrefix+"."+name+".>"))
	if err != nil {
		e.T.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			continue // deleted
		}
		if m.Header.Get(subscribers.DeadSubscriberHeader) == name {
			out = append(out, m)
		}
	}
	return out
}

// Republish publishes the stored message of event id again under a new
// Nats-Msg-Id, so JetStream stores it a second time: a duplicate event that
// got past JetStream's window.
func (e *Env) Republish(id int64) {
	e.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := e.JS.Stream(ctx, e.Config.Stream.Name)
	if err != nil {
		e.T.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		e.T.Fatal(err)
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil || m.Header.Get(wire.EventIDHeader) != strconv.FormatInt(id, 10) {
			continue
		}
		msg := nats.NewMsg(m.Subject)
		msg.Data = m.Data
		for k, v := range m.Header {
			if k != "Nats-Msg-Id" {
				msg.Header[k] = v
			}
		}
		if _, err := e.JS.PublishMsg(ctx, msg, jetstream.WithMsgID("again-"+strconv.FormatInt(id, 10)+"-"+strconv.FormatInt(time.Now().UnixNano(), 10))); err != nil {
			e.T.Fatal(err)
		}
		return
	}
	e.T.Fatalf("event %d not in the stream", id)
}

// WaitAllSent waits until the relay has published every outbox row.
func (e *Env) WaitAllSent() {
	e.T.Helper()
	WaitFor(e.T, time.Minute, "every event published", func() (bool, string) {
		unsent, err := outboxstore.New(e.DB.Pool).Unsent(context.Background(), nil)
		if err != nil {
			return false, err.Error()
		}
		return unsent == 0, strconv.FormatInt(unsent, 10) + " unsent"
	})
}

// WaitSent waits until the relay has published the events (their outbox
// rows are sent), so that a following WaitIdle means they were handled.
func (e *Env) WaitSent(ids ...int64) {
	e.T.Helper()
	if len(ids) == 0 {
		return
	}
	WaitFor(e.T, time.Minute, "events published", func() (bool, string) {
		unsent, err := outboxstore.New(e.DB.Pool).Unsent(context.Background(), ids)
		if err != nil {
			return false, err.Error()
		}
		return unsent == 0, strconv.FormatInt(unsent, 10) + " unsent"
	})
}

// Settle waits until every outbox row is published and the subscriber has
// handled everything published: the pipeline is quiet.
func (e *Env) Settle(name string) {
	e.T.Helper()
	e.WaitAllSent()
	e.WaitIdle(name, time.Minute)
}

// ExpireStream lets the stream's retention drop every event it holds, as
// stream.max_age does once they are older than it: its max age is
// shortened for a moment (the stream denies purges), then restored.
func (e *Env) ExpireStream() {
	e.T.Helper()
	ctx := context.Background()
	events, err := e.JS.Stream(ctx, e.Config.Stream.Name)
	if err != nil {
		e.T.Fatal(err)
	}
	was := events.CachedInfo().Config
	short := was
	short.MaxAge, short.Duplicates = 2*time.Second, time.Second
	if _, err := e.JS.UpdateStream(ctx, short); err != nil {
		e.T.Fatal(err)
	}
	WaitFor(e.T, 30*time.Second, "the stream to drop its events", func() (bool, string) {
		info, err := events.Info(ctx)
		if err != nil {
			return false, err.Error()
		}
		return info.State.Msgs == 0, fmt.Sprint(info.State.Msgs, " messages")
	})
	if _, err := e.JS.UpdateStream(ctx, was); err != nil {
		e.T.Fatal(err)
	}
}
