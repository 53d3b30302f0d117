package relay

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// harness is one test's real Postgres database and real nats-server.
type harness struct {
	t    testing.TB
	db   *pgtest.DB
	nats *natstest.Server
	cfg  *testConfig
}

// testConfig is the relay's and the stream's settings for one test.
type testConfig struct {
	Relay  Config
	Stream stream.Config
}

func newHarness(t testing.TB, opts ...natstest.Option) *harness {
	t.Helper()
	cfg := &testConfig{Relay: DefaultConfig(), Stream: stream.DefaultConfig()}
	cfg.Relay.PollInterval = 50 * time.Millisecond
	cfg.Relay.RetryMin = 50 * time.Millisecond
	cfg.Relay.RetryMax = 500 * time.Millisecond
	cfg.Relay.PublishTimeout = 2 * time.Second
	// The auditor at a test's pace: ranges wait for its audits.
	cfg.Relay.AuditInterval = 100 * time.Millisecond
	cfg.Relay.AuditDelay = 200 * time.Millisecond
	cfg.Relay.AuditLookback = time.Minute
	return &harness{t: t, db: pgtest.NewDB(t), nats: natstest.Start(t, opts...), cfg: cfg}
}

func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// connect returns a relay-style connection to the test server.
func (h *harness) connect() *nats.Conn {
	h.t.Helper()
	nc, err := nats.Connect(h.nats.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(nc.Close)
	return nc
}

// startRelay starts a relay with the harness config, adjusted by mutate,
// and stops it when the test ends.
func (h *harness) startRelay(mutate func(*Config), obs Observer) *Relay {
	h.t.Helper()
	r := h.newRelay(mutate, obs)
	h.start(r)
	return r
}

// forEachCapture runs test in parallel subtests, one per capture mode, each
// with a harness of its own: the relay's contract holds in both.
func forEachCapture(t *testing.T, test func(t *testing.T, h *harness), opts ...natstest.Option) {
	for _, capture := range []string{CapturePoll, CaptureWAL} {
		t.Run(capture, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, opts...)
			h.cfg.Relay.Capture = capture
			test(t, h)
		})
	}
}

// wal reports whether the harness's relays capture from the WAL.
func (h *harness) wal() bool { return h.cfg.Relay.Capture == CaptureWAL }

// newRelay returns a relay that is not started yet.
func (h *harness) newRelay(mutate func(*Config), obs Observer) *Relay {
	h.t.Helper()
	rc := h.cfg.Relay
	// Slot names are cluster-wide, test databases are not. A poll relay
	// looks for the slot too (a switch back from wal capture).
	rc.Slot = h.db.Name
	if mutate != nil {
		mutate(&rc)
	}
	r, err := New(Options{Relay: rc, Stream: h.cfg.Stream, Pool: h.db.Pool, Conn: h.connect(), Logger: testLogger(h.t), Observer: obs})
	if err != nil {
		h.t.Fatal(err)
	}
	// What Start reads, for tests that build messages without starting.
	r.origin.identity.Store(h.identity())
	return r
}

// identity is the test database's identity.
func (h *harness) identity() *outbox.Identity {
	h.t.Helper()
	ident, err := outboxstore.New(h.db.Pool).ReadIdentity(context.Background())
	if err != nil {
		h.t.Fatal(err)
	}
	return ident
}

// start starts r and stops it when the test ends.
func (h *harness) start(r *Relay) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Start(testhooks.WithRelay(ctx, r.hooks)); err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Stop(ctx)
	})
}

// write commits one event per type in its own transaction and returns the ids.
func write(t *testing.T, pool *pgxpool.Pool, events ...outbox.Event) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, e := range events {
			id, err := outbox.Write(ctx, tx, e)
			if err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func productEvent(n int) outbox.Event {
	return outbox.Event{
		AggregateType: "product",
		AggregateID:   strconv.Itoa(n),
		Type:          "product.updated",
		Payload:       map[string]int{"product_id": n, "price_cents": 100 * n},
	}
}

// writeMany commits n product events in transactions of 500.
func writeMany(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	for done := 0; done < n; {
		batch := make([]outbox.Event, 0, 500)
		for i := 0; i < 500 && done < n; i++ {
			done++
			batch = append(batch, productEvent(done))
		}
		write(t, pool, batch...)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last string
	for {
		ok, state := cond()
		if ok {
			return
		}
		last = state
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; last state: %s", timeout, what, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// statusCounts returns how many outbox rows are in each status.
func statusCounts(t testing.TB, pool *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT status, count(*) FROM outbox GROUP BY status`)
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			t.Fatal(err)
		}
		counts[s] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return counts
}

// launch starts r around writes: in poll capture after them (the claim
// finds them in the table), in wal capture before them, once the relay
// streams from its slot (rows committed before the slot are claimed, not
// decoded).
func (h *harness) launch(r *Relay, writes func()) {
	h.t.Helper()
	if !h.wal() {
		writes()
		h.start(r)
		return
	}
	h.start(r)
	h.waitStreaming(r)
	writes()
}

// waitStreaming waits until r streams from its slot. Making a slot waits
// for every transaction open in the cluster to end, twice, and the relay
// package's tests write beside each other in many databases of one
// server: CI's loaded machine took more than 20 s.
func (h *harness) waitStreaming(r *Relay) {
	h.t.Helper()
	waitFor(h.t, 60*time.Second, "the relay streaming from its slot", func() (bool, string) {
		return r.wal.state.Load() == captureStreaming, fmt.Sprintf("capture state %d", r.wal.state.Load())
	})
}

// waitAllSent waits until n rows are published: marked sent in poll
// capture; in the stream in wal capture, where the relay marks nothing.
func (h *harness) waitAllSent(n int, timeout time.Duration) {
	h.t.Helper()
	if h.wal() {
		waitFor(h.t, timeout, strconv.Itoa(n)+" events in the stream", func() (bool, string) {
			got := h.streamCount()
			return got == n, strconv.Itoa(got) + " in the stream"
		})
		return
	}
	waitFor(h.t, timeout, strconv.Itoa(n)+" rows sent", func() (bool, string) {
		c := statusCounts(h.t, h.db.Pool)
		return c["sent"] == n, formatCounts(c)
	})
}

func formatCounts(c map[string]int) string {
	return "pending=" + strconv.Itoa(c["pending"]) + " sending=" + strconv.Itoa(c["sending"]) +
		" sent=" + strconv.Itoa(c["sent"]) + " failed=" + strconv.Itoa(c["failed"])
}

// streamCount is how many messages the stream holds (0 if it does not exist
// yet or NATS is down).
func (h *harness) streamCount() int {
	h.t.Helper()
	nc, err := nats.Connect(h.nats.URL)
	if err != nil {
		return 0
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return 0
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, h.cfg.Stream.Name)
	if err != nil {
		return 0
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0
	}
	return int(info.State.Msgs)
}

// streamMessages reads every message stored in the stream.
func (h *harness) streamMessages() []*jetstream.RawStreamMsg {
	h.t.Helper()
	js, err := jetstream.New(h.connect())
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, h.cfg.Stream.Name)
	if err != nil {
		h.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	var msgs []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			h.t.Fatalf("get message %d: %v", seq, err)
		}
		msgs = append(msgs, m)
	}
	return msgs
}

// recorder is an Observer that remembers what it saw.
type recorder struct {
	NopObserver
	mu        sync.Mutex
	published []Published
	claimed   int
	retried   int
	failed    int
	reaped    int
	lagBytes  int64
	lagStuck  time.Duration
}

func (r *recorder) Claimed(n int, _ time.Duration) { r.mu.Lock(); r.claimed += n; r.mu.Unlock() }
func (r *recorder) Published(ev []Published) {
	r.mu.Lock()
	r.published = append(r.published, ev...)
	r.mu.Unlock()
}
func (r *recorder) Retried(n int) { r.mu.Lock(); r.retried += n; r.mu.Unlock() }
func (r *recorder) Failed(n int)  { r.mu.Lock(); r.failed += n; r.mu.Unlock() }
func (r *recorder) Reaped(n int)  { r.mu.Lock(); r.reaped += n; r.mu.Unlock() }
func (r *recorder) SlotLag(bytes int64, stuck time.Duration) {
	r.mu.Lock()
	r.lagBytes, r.lagStuck = bytes, stuck
	r.mu.Unlock()
}

func (r *recorder) snapshot() (published []Published, reaped int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Published(nil), r.published...), r.reaped
}
