package relay

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// A consumer turned against another's (a push consumer delivering into the
// JetStream API; one moved past the stream's last message) makes the relay
// not ready, naming it, until it is gone; the nats CLI's views (push
// consumers into an inbox) do not.
func TestTheRelayIsNotReadyWhileAConsumerIsTurnedAgainstAnother(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	// Each check may take up to its interval: under load, a shorter one
	// would see every check cut short.
	h.cfg.Stream.CheckInterval = time.Second
	r := h.startRelay(nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, err := jetstream.New(h.connect())
	if err != nil {
		t.Fatal(err)
	}
	write(t, h.db.Pool, productEvent(1))
	h.waitAllSent(1, 10*time.Second)
	waitReady := func(what string, want func(err error) bool) {
		t.Helper()
		deadline := time.Now().Add(45 * time.Second)
		for err := r.Ready(); !want(err); err = r.Ready() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: readiness %v", what, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	ready := func(err error) bool { return err == nil }
	waitReady("at start", ready)

	s, err := js.Stream(ctx, h.cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	// As `nats stream view` looks: an ephemeral push consumer into an
	// inbox, left while the attacks are judged.
	if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Name: "view", DeliverSubject: "_INBOX.view", AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	for _, attack := range []struct {
		name string
		make func() error
	}{
		{"pushes_into_a_reset", func() error {
			_, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "pushes_into_a_reset", DeliverSubject: "$JS.API.CONSUMER.RESET.EVENTS.invoicing",
				AckPolicy: jetstream.AckNonePolicy, FilterSubject: "events.nothing"})
			return err
		}},
		{"moved_past_the_end", func() error {
			if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "moved_past_the_end", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
				return err
			}
			_, err := s.ResetConsumerToSequence(ctx, "moved_past_the_end", 1_000_000)
			return err
		}},
	} {
		if err := attack.make(); err != nil {
			t.Fatalf("consumer %s: %v", attack.name, err)
		}
		waitReady("consumer "+attack.name, func(err error) bool {
			return err != nil && strings.Contains(err.Error(), "consumer "+attack.name+" of stream "+h.cfg.Stream.Name)
		})
		t.Logf("not ready: %v", r.Ready())
		if err := s.DeleteConsumer(ctx, attack.name); err != nil {
			t.Fatal(err)
		}
		waitReady("consumer "+attack.name+" deleted", ready)
	}
}
