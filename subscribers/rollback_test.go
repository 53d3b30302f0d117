package subscribers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/subscribertest"
)

// gated is a test subscriber whose events wait at a gate the test opens,
// and may fail their first delivery.
type gated struct {
	mu      sync.Mutex
	gates   map[string]chan struct{}
	started map[int64]int // deliveries begun, by event id
	seq     map[int64]uint64
	done    map[int64]bool
}

type gatedScript struct {
	Gate      string `json:"gate"`
	FailFirst bool   `json:"fail_first"`
}

func newGated(gates ...string) *gated {
	g := &gated{gates: map[string]chan struct{}{}, started: map[int64]int{}, seq: map[int64]uint64{}, done: map[int64]bool{}}
	for _, name := range gates {
		g.gates[name] = make(chan struct{})
	}
	return g
}

func (g *gated) Handle(ctx context.Context, ev subscribers.Event) error {
	var sc gatedScript
	_ = json.Unmarshal(ev.Payload, &sc)
	g.mu.Lock()
	g.started[ev.ID]++
	g.seq[ev.ID] = ev.StreamSeq
	gate := g.gates[sc.Gate]
	g.mu.Unlock()
	if gate != nil && ev.Delivery == 1 {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if sc.FailFirst && ev.Delivery == 1 {
		return errors.New("transient trouble")
	}
	g.mu.Lock()
	g.done[ev.ID] = true
	g.mu.Unlock()
	return nil
}

func (g *gated) state(id int64) (started int, seq uint64, done bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.started[id], g.seq[id], g.done[id]
}

// A nats-server restarted from a store that lost messages it had
// acknowledged gives their stream sequences to new messages, and JetStream
// settles a message by its sequence alone. An event in hand across that
// restart (here held at a gate) must not, when it is done, settle the new
// event that took its sequence: that event failed once and has to come
// back. Acked, it was never delivered again, neither handled nor
// dead-lettered (the fault run's cache invalidator lost 2 and 13 events
// so, after a store rollback).
func TestAReplyForAMessageBeforeAStoreRollbackSettlesNothingAfter(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnvWith(t, func(c *subscribertest.Config) {
		c.Relay.Audit = false // the event the stream lost stays lost: its sequence goes to the next
		c.Subscribers.HandlerTimeout = time.Minute
	})
	env.Config.Subscribers.AckWait = 2 * time.Second
	h := newGated("before", "after")
	const name = "rollback"
	env.StartRunner(subscribertest.Declare(name, subscribers.Each(h), "test.>"), nil)
	event := func(sc gatedScript) outbox.Event {
		return outbox.Event{AggregateType: "test", AggregateID: "1", Type: "test.event", Payload: sc}
	}

	first := write(env, event(gatedScript{}))[0]
	subscribertest.WaitFor(t, 20*time.Second, "the first event", func() (bool, string) { _, _, done := h.state(first); return done, "" })
	env.WaitIdle(name, 15*time.Second)

	env.NATS.Stop()
	snapshot, err := env.NATS.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if err := env.NATS.Restart(); err != nil {
		t.Fatal(err)
	}

	held := write(env, event(gatedScript{Gate: "before"}))[0]
	subscribertest.WaitFor(t, 20*time.Second, "the held event in hand", func() (bool, string) { n, _, _ := h.state(held); return n == 1, "" })

	env.NATS.Kill()
	if err := env.NATS.RollBack(snapshot); err != nil {
		t.Fatal(err)
	}
	if err := env.NATS.Restart(); err != nil {
		t.Fatal(err)
	}

	next := write(env, event(gatedScript{Gate: "after", FailFirst: true}))[0]
	subscribertest.WaitFor(t, 30*time.Second, "the next event in hand", func() (bool, string) { n, _, _ := h.state(next); return n == 1, "" })
	_, heldSeq, _ := h.state(held)
	_, nextSeq, _ := h.state(next)
	if heldSeq != nextSeq {
		t.Fatalf("the premise: the next event at the held one's sequence, got %d and %d", heldSeq, nextSeq)
	}

	h.mu.Lock()
	close(h.gates["before"])
	h.mu.Unlock()
	subscribertest.WaitFor(t, 20*time.Second, "the held event handled", func() (bool, string) { return env.Checkpointed(name, held), "" })
	// What the runner sends for the held event has reached the server when
	// the next event is no longer ack pending, or after a second.
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if _, ackPending, err := env.ConsumerState(name); err == nil && ackPending == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}

	h.mu.Lock()
	close(h.gates["after"])
	h.mu.Unlock()
	subscribertest.WaitFor(t, 30*time.Second, "the next event handled after its failure", func() (bool, string) {
		n, _, done := h.state(next)
		pending, ackPending, err := env.ConsumerState(name)
		return done, fmt.Sprintf("%d deliveries; consumer: %d pending, %d ack pending (%v)", n, pending, ackPending, err)
	})
	subscribertest.WaitFor(t, 10*time.Second, "the next event in the checkpoint", func() (bool, string) { return env.Checkpointed(name, next), "" })
}
