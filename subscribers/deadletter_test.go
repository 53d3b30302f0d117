package subscribers

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"testing"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A dead letter carries the event's body and headers (not JetStream's),
// the subscriber, the reason and where the event was; it is stored once
// however often a crash makes the runtime publish it; an event too large
// to travel with the letter's own headers leaves its body behind.
func TestDeadLetterPublish(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ns := natstest.Start(t)
	nc, err := nats.Connect(ns.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	if err := ensureDeadLetterStream(ctx, js, cfg, 1, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		t.Fatal(err)
	}
	dl := &deadLetters{name: "invoicing", cfg: cfg, subjectPrefix: "events", js: js, conn: nc}
	h := nats.Header{"Nats-Msg-Id": {"events:42"}, wire.EventIDHeader: {"42"}}
	for range 2 {
		if err := dl.publish(ctx, []byte(`{"order_id": 1}`), h, "events.order.created", 17, 3, "unknown order", 0); err != nil {
			t.Fatal(err)
		}
	}
	big := make([]byte, nc.MaxPayload()-100)
	if err := dl.publish(ctx, big, h, "events.order.created", 18, 1, "held", 42); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, cfg.DeadLetterStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.Msgs != 2 {
		t.Fatalf("%d letters stored (%v), want 2: one per event however often published", info.State.Msgs, err)
	}
	first, err := s.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{DeadSubscriberHeader: "invoicing", DeadReasonHeader: "unknown order", DeadDeliveriesHeader: "3",
		DeadSubjectHeader: "events.order.created", DeadStreamSeqHeader: "17", wire.EventIDHeader: "42"}
	for k, v := range want {
		if got := first.Header.Get(k); got != v {
			t.Errorf("letter header %s = %q, want %q", k, got, v)
		}
	}
	if first.Subject != "deadletter.invoicing.order.created" || string(first.Data) != `{"order_id": 1}` || first.Header.Get(DeadAtHeader) == "" {
		t.Errorf("letter %s %q %v", first.Subject, first.Data, first.Header)
	}
	if got := first.Header.Get("Nats-Msg-Id"); got != "invoicing.17" {
		t.Errorf("letter's Nats-Msg-Id %q, want its own (invoicing.17), not the event's", got)
	}
	second, err := s.GetMsg(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(second.Data) != 0 || second.Header.Get(DeadBodyOmittedHeader) != strconv.Itoa(len(big)) || second.Header.Get(DeadHeldByHeader) != "42" {
		t.Errorf("a letter too large for its body: %d bytes, omitted %q, held by %q", len(second.Data),
			second.Header.Get(DeadBodyOmittedHeader), second.Header.Get(DeadHeldByHeader))
	}
}
