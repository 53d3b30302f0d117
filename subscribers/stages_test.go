package subscribers_test

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// counting handles test.* events, after a delay, and counts them.
type counting struct {
	name  string
	delay time.Duration
	mu    sync.Mutex
	n     int
}

func (c *counting) Handle(ctx context.Context, _ subscribers.Event) error {
	select {
	case <-time.After(c.delay):
	case <-ctx.Done():
		return ctx.Err()
	}
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
	return nil
}

func (c *counting) handled() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// pipeline is a real relay and subscriber runtime reporting into one
// registry's stage recorder.
type pipeline struct {
	t      *testing.T
	cfg    *subscribertest.Config
	db     *pgtest.DB
	url    string
	stages *metrics.StageRecorder
	reg    *prometheus.Registry
}

func (p *pipeline) conn() *nats.Conn {
	nc, err := nats.Connect(p.url)
	if err != nil {
		p.t.Fatal(err)
	}
	p.t.Cleanup(nc.Close)
	return nc
}

// runnable is what the relay and a subscriber runner have in common.
type runnable interface {
	Start(context.Context) error
	Stop(context.Context) error
}

// start starts what New built, and stops it when the test ends.
func (p *pipeline) start(r runnable, err error) {
	if err != nil {
		p.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Start(ctx); err != nil {
		p.t.Fatal(err)
	}
	p.t.Cleanup(func() { _ = r.Stop(context.Background()) })
}

func (p *pipeline) startRelay() {
	p.start(relay.New(relay.Options{Relay: p.cfg.Relay, Stream: p.cfg.Stream, Pool: p.db.Pool, Conn: p.conn(),
		Logger: slog.New(slog.DiscardHandler), Observer: relay.NewMetrics(p.reg)}))
}

func (p *pipeline) startSubscriber(h *counting) {
	p.start(subscribers.New(subscribers.Options{Declaration: subscribertest.Declare(h.name, subscribers.Each(h), "test.>"),
		Handler: subscribers.Each(h), Config: p.cfg.Subscribers, Stream: p.cfg.Stream,
		Pool: p.db.Pool, Conn: p.conn(), Logger: slog.New(slog.DiscardHandler), Observer: subscribers.NewMetrics(p.reg)}))
}

// write commits n events, gap apart.
func (p *pipeline) write(n int, gap time.Duration) {
	for i := range n {
		time.Sleep(gap)
		err := pgx.BeginFunc(context.Background(), p.db.Pool, func(tx pgx.Tx) error {
			_, err := outbox.Write(context.Background(), tx, outbox.Event{AggregateType: "test", AggregateID: strconv.Itoa(i), Type: "test.stage", Payload: map[string]int{"i": i}})
			return err
		})
		if err != nil {
			p.t.Fatal(err)
		}
	}
}

func (p *pipeline) waitHandled(h *counting, n int) {
	deadline := time.Now().Add(30 * time.Second)
	for h.handled() < n {
		if time.Now().After(deadline) {
			p.t.Fatalf("%d of %d events handled after 30 s", h.handled(), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // the checkpoint and ack after the last
	// The relay observes its publishes when it has recorded them, which
	// may be after the subscriber handled them (CI's busy host saw no
	// sample yet).
	for {
		if _, ok := p.quantiles("")[metrics.StagePublished]; ok {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("the relay recorded no publish after 30 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// quantiles reads each stage's p50 and p99 (seconds) for subscriber (the
// relay's stage is read whatever subscriber is asked).
func (p *pipeline) quantiles(subscriber string) map[string][2]float64 {
	out := map[string][2]float64{}
	for _, w := range p.stages.LastMinute() {
		if w.Subscriber == subscriber || w.Stage == metrics.StagePublished {
			out[w.Stage] = [2]float64{w.Quantile(0.5), w.Quantile(0.99)}
		}
	}
	return out
}

func newPipeline(t *testing.T) *pipeline {
	cfg := subscribertest.DefaultConfig()
	cfg.Relay.PollInterval = 20 * time.Millisecond
	reg := prometheus.NewRegistry()
	return &pipeline{t: t, cfg: cfg, db: pgtest.NewDB(t), url: natstest.Start(t).URL, reg: reg, stages: metrics.StagesOf(reg)}
}

// undelayed checks that each of stages was recorded, and that its median
// is under half the delayed stage's: the time went to the stage the test
// delayed, not to these. (Relative, not a fixed bound: on a busy host
// every stage is slower, but the delay still shows where it was put.)
func undelayed(t *testing.T, q map[string][2]float64, delayed string, stages ...string) {
	t.Helper()
	for _, stage := range stages {
		if got, ok := q[stage]; !ok || got[0] >= q[delayed][0]/2 {
			t.Errorf("%s: recorded %v, p50 %.3fs; want it recorded and under half of %s's p50 %.3fs (that stage was not delayed)",
				stage, ok, got[0], delayed, q[delayed][0])
		}
	}
}

// Delaying one stage on purpose moves that stage's latency, and only
// that one's: the stage histograms say where an event's time goes.
func TestStageLatencyFollowsTheDelayedStage(t *testing.T) {
	const events = 20
	t.Run("relay late", func(t *testing.T) {
		p := newPipeline(t)
		h := &counting{name: "stages"}
		// The subscriber waits on the stream; the relay starts 1.5 s
		// after the writes committed.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		js, err := jetstream.New(p.conn())
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Ensure(ctx, js, p.cfg.Stream, 0, slog.New(slog.DiscardHandler)); err != nil {
			t.Fatal(err)
		}
		p.startSubscriber(h)
		p.write(events, 0)
		time.Sleep(1500 * time.Millisecond)
		p.startRelay()
		p.waitHandled(h, events)
		q := p.quantiles(h.name)
		t.Logf("p50/p99 s: %v", q)
		if got := q[metrics.StagePublished][0]; got < 1.2 {
			t.Errorf("commit → PubAck p50 %.3fs with the relay 1.5 s late, want >= 1.2s", got)
		}
		undelayed(t, q, metrics.StagePublished, metrics.StageDelivered, metrics.StageHandled)
	})
	t.Run("handler slow", func(t *testing.T) {
		p := newPipeline(t)
		h := &counting{name: "stages", delay: 300 * time.Millisecond}
		p.startRelay()
		p.startSubscriber(h)
		// Written slower than the 4 workers handle them, so no event
		// waits for a worker (that wait would show before delivery).
		p.write(events, 150*time.Millisecond)
		p.waitHandled(h, events)
		q := p.quantiles(h.name)
		t.Logf("p50/p99 s: %v", q)
		if got := q[metrics.StageHandled][0]; got < 0.3 {
			t.Errorf("delivered → handled p50 %.3fs with a 300 ms handler, want >= 0.3s", got)
		}
		undelayed(t, q, metrics.StageHandled, metrics.StagePublished, metrics.StageDelivered)
	})
}
