package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
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

// A stream that exists is changed only when asked, a lower limit only when
// asked twice; --check lists every difference of streams and consumers,
// field by field, and changes nothing.
func TestProvisionChangesAStreamOnlyWhenTold(t *testing.T) {
	t.Parallel()
	ns := natstest.Start(t)
	db := pgtest.NewDB(t)
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + ns.URL, "FANOUT_LOG_FORMAT=json"}
	if out, err := run(t, env, "provision"); err != nil {
		t.Fatalf("fanout provision: %v\n%s", err, out)
	}
	if out, err := run(t, env, "provision", "--check"); err != nil || !strings.Contains(out, "stream EVENTS: as configured") || !strings.Contains(out, "consumer invoicing: as configured") {
		t.Fatalf("provision --check right after provision: %v\n%s", err, out)
	}
	js, err := jetstream.New(ns.Connect(t))
	if err != nil {
		t.Fatal(err)
	}
	// One bound for the test's own calls to the server, between a dozen
	// runs of the race-built binary: 10 s ran out between them in a CI
	// run with empty caches.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	maxAge := func() time.Duration {
		t.Helper()
		s, err := js.Stream(ctx, "EVENTS")
		if err != nil {
			t.Fatal(err)
		}
		return s.CachedInfo().Config.MaxAge
	}

	// Someone lowered invoicing's max_deliver: --check names the field and
	// both values, and fails.
	c, err := js.Consumer(ctx, "EVENTS", "invoicing")
	if err != nil {
		t.Fatal(err)
	}
	cc := c.CachedInfo().Config
	cc.MaxDeliver = 1
	if _, err := js.UpdateConsumer(ctx, "EVENTS", cc); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, env, "provision", "--check")
	if err == nil || !strings.Contains(out, "consumer invoicing: max_deliver is 1, fanout's configuration says unlimited") {
		t.Errorf("provision --check after a consumer change: %v\n%s", err, out)
	}

	longer := append(env, "FANOUT_STREAM_MAX_AGE=336h")
	out, err = run(t, longer, "provision")
	if err == nil || !strings.Contains(out, "max_age is 168h0m0s, fanout's configuration says 336h0m0s") || !strings.Contains(out, "--update-stream EVENTS") {
		t.Errorf("provision of a longer max age without --update-stream: %v\n%s; want refused, naming the field", err, out)
	}
	if got := maxAge(); got != 168*time.Hour {
		t.Errorf("max age %s after a refused provision", got)
	}
	if out, err := run(t, longer, "provision", "--update-stream", "EVENTS"); err != nil {
		t.Errorf("provision --update-stream EVENTS of a longer max age: %v\n%s", err, out)
	}
	if got := maxAge(); got != 336*time.Hour {
		t.Errorf("max age %s after provision --update-stream EVENTS, want 336h", got)
	}
	// --update-stream does nothing else; provision then brings the
	// consumer back.
	if c, err = js.Consumer(ctx, "EVENTS", "invoicing"); err != nil || c.CachedInfo().Config.MaxDeliver != 1 {
		t.Errorf("invoicing's consumer after --update-stream: %v, max_deliver %d; want it untouched", err, c.CachedInfo().Config.MaxDeliver)
	}
	if out, err := run(t, longer, "provision"); err != nil {
		t.Errorf("provision: %v\n%s", err, out)
	}
	if c, err = js.Consumer(ctx, "EVENTS", "invoicing"); err != nil || c.CachedInfo().Config.MaxDeliver != -1 {
		t.Errorf("invoicing's consumer after provision: %v, max_deliver %d", err, c.CachedInfo().Config.MaxDeliver)
	}

	out, err = run(t, env, "provision", "--update-stream", "EVENTS")
	if err == nil || !strings.Contains(out, "max_age is 336h0m0s, fanout's configuration says 168h0m0s (a lower limit)") || !strings.Contains(out, "--allow-lower") {
		t.Errorf("provision --update-stream EVENTS of a shorter max age: %v\n%s; want refused as a lower limit", err, out)
	}
	if got := maxAge(); got != 336*time.Hour {
		t.Errorf("max age %s after a refused lowering", got)
	}
	if out, err := run(t, env, "provision", "--update-stream", "EVENTS", "--allow-lower"); err != nil {
		t.Errorf("provision --update-stream EVENTS --allow-lower: %v\n%s", err, out)
	}
	if got := maxAge(); got != 168*time.Hour {
		t.Errorf("max age %s after an allowed lowering, want 168h", got)
	}
	if out, err := run(t, env, "provision", "--allow-lower"); err == nil || !strings.Contains(out, "--allow-lower goes with --update-stream") {
		t.Errorf("--allow-lower alone: %v\n%s", err, out)
	}
	if out, err := run(t, env, "provision", "--update-stream", "ORDERS"); err == nil || !strings.Contains(out, "fanout has streams EVENTS and DEADLETTER only") {
		t.Errorf("--update-stream of another stream: %v\n%s", err, out)
	}
}

// The stream records the database that owns it: `fanout provision` from
// stream.database, shared from stream.databases several; status shows the
// database, its epoch and the owner, and says when it is another database.
func TestProvisionRecordsTheStreamsOwner(t *testing.T) {
	t.Parallel()
	ns := natstest.Start(t)
	db := pgtest.NewDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	own, err := outbox.ReadDatabase(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + ns.URL, "FANOUT_LOG_FORMAT=json"}
	js, err := jetstream.New(ns.Connect(t))
	if err != nil {
		t.Fatal(err)
	}
	owner := func() string {
		t.Helper()
		s, err := js.Stream(ctx, "EVENTS")
		if err != nil {
			t.Fatal(err)
		}
		return s.CachedInfo().Config.Metadata[stream.OwnerKey]
	}

	if out, err := run(t, append(env, "FANOUT_STREAM_DATABASE=shop"), "provision"); err == nil || !strings.Contains(out, "stream.database") {
		t.Fatalf("provision with a stream.database that names no database: %v\n%s; want refused, naming the key", err, out)
	}
	if out, err := run(t, append(env, "FANOUT_STREAM_DATABASE="+own.String()), "provision"); err != nil {
		t.Fatalf("provision: %v\n%s", err, out)
	}
	if got := owner(); got != own.String() {
		t.Fatalf("stream EVENTS records owner %q, want %s", got, own)
	}
	st := status(t, env)
	if st.Database.Name != own.String() || st.Database.Epoch != 1 || st.Stream.Owner != own.String() || st.Stream.Foreign {
		t.Fatalf("status: database %+v, stream %+v", st.Database, st.Stream)
	}

	// Shared on purpose: only --update-stream, as the stream's
	// administrator, records it.
	shared := append(env, "FANOUT_STREAM_DATABASES=several")
	if out, err := run(t, shared, "provision"); err == nil || !strings.Contains(out, "fanout.database") {
		t.Fatalf("provision of a shared stream over an owned one: %v\n%s; want refused, naming the owner", err, out)
	}
	if out, err := run(t, shared, "provision", "--update-stream", "EVENTS"); err != nil {
		t.Fatalf("provision --update-stream EVENTS: %v\n%s", err, out)
	}
	if got := owner(); got != stream.SeveralDatabases {
		t.Fatalf("stream EVENTS records owner %q after sharing it, want %s", got, stream.SeveralDatabases)
	}

	other := outbox.Database{System: own.System, Name: "another shop"}
	if out, err := run(t, append(env, "FANOUT_STREAM_DATABASE="+other.String()), "provision", "--update-stream", "EVENTS"); err != nil {
		t.Fatalf("provision --update-stream EVENTS to another owner: %v\n%s", err, out)
	}
	out, err := run(t, env, "status")
	if err != nil || !strings.Contains(out, "owner "+other.String()+" (ANOTHER DATABASE") || !strings.Contains(out, "database "+own.String()+"  outbox epoch 1") {
		t.Fatalf("status of a stream another database owns: %v\n%s", err, out)
	}
}
