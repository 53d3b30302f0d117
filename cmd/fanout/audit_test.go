package main

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// fanout audit finds the events a broker lost after their PubAck (its
// store rolled back to an earlier copy), reports them with --dry-run, and
// publishes them again; fanout status shows the audit.
func TestAuditCommand(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ns := natstest.Start(t)
	db := pgtest.NewDB(t)
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + ns.URL, "FANOUT_LOG_FORMAT=json"}
	write := func(n int) {
		t.Helper()
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			for i := range n {
				if _, err := outbox.Write(ctx, tx, outbox.Event{AggregateType: "thing", AggregateID: "x" + string(rune('a'+i)), Type: "thing.made", Payload: map[string]int{"n": i}}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	nc, err := nats.Connect(ns.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	cfg := relay.DefaultConfig()
	cfg.Audit = false // the command's to find
	cfg.PollInterval = 50 * time.Millisecond
	r, err := relay.New(relay.Options{Relay: cfg, Stream: stream.DefaultConfig(), Pool: db.Pool, Conn: nc, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	count := func() uint64 {
		s, err := js.Stream(ctx, "EVENTS")
		if err != nil {
			return 0
		}
		return s.CachedInfo().State.Msgs
	}
	waitCount := func(n uint64) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for count() != n {
			if time.Now().After(deadline) {
				t.Fatalf("stream holds %d events, want %d", count(), n)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	write(5)
	waitCount(5)
	ns.Stop()
	snapshot, err := ns.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if err := ns.Restart(); err != nil {
		t.Fatal(err)
	}
	write(5)
	waitCount(10)
	if err := r.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	ns.Stop()
	if err := ns.RollBack(snapshot); err != nil {
		t.Fatal(err)
	}
	if err := ns.Restart(); err != nil {
		t.Fatal(err)
	}
	waitCount(5)

	out, err := run(t, env, "audit", "--dry-run")
	if err == nil || !strings.Contains(out, "audited 10 events") || !strings.Contains(out, "5 missing") {
		t.Fatalf("fanout audit --dry-run after the loss: %v\n%s", err, out)
	}
	if got := count(); got != 5 {
		t.Fatalf("--dry-run published: the stream holds %d events", got)
	}
	out, err = run(t, env, "audit", "--since", "1h")
	if err != nil || !strings.Contains(out, "5 missing") || !strings.Contains(out, "5 published again") {
		t.Fatalf("fanout audit --since 1h: %v\n%s", err, out)
	}
	waitCount(10)
	out, err = run(t, env, "audit")
	if err != nil || !strings.Contains(out, "0 missing") {
		t.Fatalf("fanout audit after the repair: %v\n%s", err, out)
	}
	out, err = run(t, env, "status")
	if err != nil || !strings.Contains(out, "audit    command") || !strings.Contains(out, "5 MISSING, 5 published again") {
		t.Fatalf("fanout status after the audits: %v\n%s", err, out)
	}
}
