package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/pgtest"
	"github.com/nats-io/nats.go/jetstream"
)

// `fanout provision` creates both streams, with deletes and purges denied,
// and every subscriber's consumer with its filters; then the relay and the
// subscribers start with everything set to verify (as in production, where
// they may not create anything), and run twice it changes nothing.
func TestProvisionThenVerify(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ns := natstest.Start(t)
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + ns.URL, "FANOUT_LOG_FORMAT=json", "FANOUT_HTTP_ADDR=127.0.0.1:0"}
	verify := append(env, "FANOUT_STREAM_PROVISION=verify", "FANOUT_SUBSCRIBERS_DEAD_LETTER_PROVISION=verify")

	if out, err := run(t, verify, "relay"); err == nil || !strings.Contains(out, "fanout provision") && !strings.Contains(out, "stream.provision=verify") {
		t.Fatalf("a relay with verify and no stream: %v\n%s; want it refused", err, out)
	}
	// Invoicing's own ack wait and ack-pending bound, over the shared ones.
	out, err := run(t, append(env, "FANOUT_SUBSCRIBERS_INVOICING_ACK_WAIT=45s", "FANOUT_SUBSCRIBERS_INVOICING_MAX_ACK_PENDING=77"), "provision")
	if err != nil {
		t.Fatalf("fanout provision: %v\n%s", err, out)
	}
	for _, want := range []string{"stream EVENTS", "stream DEADLETTER", "consumer invoicing: filters events.order.created", "consumer salesledger", "consumer cacheinval", "consumer searchindex"} {
		if !strings.Contains(out, want) {
			t.Errorf("provision output lacks %q:\n%s", want, out)
		}
	}
	js, err := jetstream.New(ns.Connect(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, name := range []string{"EVENTS", "DEADLETTER"} {
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if c := s.CachedInfo().Config; !c.DenyDelete || !c.DenyPurge {
			t.Errorf("stream %s allows deletes (%v) or purges (%v)", name, !c.DenyDelete, !c.DenyPurge)
		}
	}
	for name, want := range map[string][2]any{"invoicing": {45 * time.Second, 77}, "salesledger": {30 * time.Second, 1000}} {
		c, err := js.Consumer(ctx, "EVENTS", name)
		if err != nil {
			t.Fatal(err)
		}
		if got := c.CachedInfo().Config; got.AckWait != want[0] || got.MaxAckPending != want[1] {
			t.Errorf("consumer %s: ack wait %s, max ack pending %d; want %v", name, got.AckWait, got.MaxAckPending, want)
		}
	}
	if out, err := run(t, env, "provision"); err != nil {
		t.Fatalf("fanout provision a second time: %v\n%s", err, out)
	}

	relayProc := start(t, verify, "relay")
	subs := start(t, verify, "subscribe", "invoicing", "salesledger")
	for _, p := range []*process{relayProc, subs} {
		if code, body := get(t, p.opsAddr(t), "/readyz"); code != 200 {
			t.Errorf("a role with provision verify is not ready: %d %s", code, body)
		}
	}
}
