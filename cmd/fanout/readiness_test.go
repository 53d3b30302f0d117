package main

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/nats-io/nats.go/jetstream"
)

// Readiness says whether this relay can do its work, from its own state:
// a row backing off after failed publishes (old, pending, in the table)
// does not take a working relay out of rotation; a relay that cannot claim
// and publish (NATS down) is taken out after relay.stall_after, and comes
// back once it works again. `fanout healthcheck` says the same.
func TestRelayReadinessFollowsItsOwnProgress(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + nats.URL, "FANOUT_LOG_FORMAT=json", "FANOUT_HTTP_ADDR=127.0.0.1:0",
		"FANOUT_RELAY_POLL_INTERVAL=50ms", "FANOUT_RELAY_PUBLISH_TIMEOUT=1s", "FANOUT_RELAY_STALL_AFTER=3s",
	}
	relayProc := start(t, env, "relay")
	addr := relayProc.opsAddr(t)
	if code, body := get(t, addr, "/readyz"); code != 200 {
		t.Fatalf("a fresh relay is not ready: %d %s", code, body)
	}

	// A row that failed an hour ago and backs off for another hour.
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error, available_at, created_at)
VALUES ('product', '1', 'product.updated', '{}', 12, 'no PubAck within relay.publish_timeout', now() + interval '1 hour', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * 3 * time.Second) // three stall_afters
	for time.Now().Before(deadline) {
		if code, body := get(t, addr, "/readyz"); code != 200 {
			t.Fatalf("a working relay is not ready because of a row in backoff: %d %s", code, body)
		}
		time.Sleep(200 * time.Millisecond)
	}

	nats.Stop()
	var body string
	subscribertest.WaitFor(t, 20*time.Second, "readiness to fail on the stalled relay", func() (bool, string) {
		var code int
		code, body = get(t, addr, "/readyz")
		return code == 503 && strings.Contains(body, "relay stalled"), body
	})
	if !strings.Contains(body, "nats") {
		t.Errorf("/readyz while stalled: %s; want nats named", body)
	}
	hc := exec.Command(binary, "healthcheck")
	hc.Env = append(os.Environ(), "FANOUT_HTTP_ADDR="+addr)
	if out, err := hc.CombinedOutput(); err == nil {
		t.Errorf("fanout healthcheck on a stalled relay succeeded: %s", out)
	}
	if err := nats.Restart(); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, 20*time.Second, "readiness to come back", func() (bool, string) {
		code, body := get(t, addr, "/readyz")
		return code == 200, body
	})
	hc = exec.Command(binary, "healthcheck")
	hc.Env = append(os.Environ(), "FANOUT_HTTP_ADDR="+addr)
	if out, err := hc.CombinedOutput(); err != nil || !strings.Contains(string(out), "ready") {
		t.Errorf("fanout healthcheck on a ready relay: %v %s", err, out)
	}
}

// The relay and a subscriber check the live stream and consumer against
// the configuration (stream.check_interval): a setting changed behind
// their back (invoicing's consumer delivering each event once, the stream
// keeping fewer messages) makes them not ready, names the field and both
// values in the log and in /readyz, and counts in a metric; restored, they
// are ready again.
func TestRolesReportASettingChangedBehindTheirBack(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ns := natstest.Start(t)
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + ns.URL, "FANOUT_LOG_FORMAT=json", "FANOUT_HTTP_ADDR=127.0.0.1:0",
		"FANOUT_STREAM_CHECK_INTERVAL=200ms"}
	relayProc := start(t, env, "relay")
	subs := start(t, env, "subscribe", "invoicing")
	subs.waitStarted(t, "invoicing")
	ready := func(p *process, want int, contains string) {
		t.Helper()
		subscribertest.WaitFor(t, 15*time.Second, "readiness "+strconv.Itoa(want), func() (bool, string) {
			code, body := get(t, p.opsAddr(t), "/readyz")
			return code == want && strings.Contains(body, contains), body
		})
	}
	ready(relayProc, 200, "")
	ready(subs, 200, "")

	js, err := jetstream.New(ns.Connect(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatal(err)
	}
	orig := s.CachedInfo().Config
	changed := orig
	changed.MaxMsgs = 1_000_000
	if _, err := js.UpdateStream(ctx, changed); err != nil {
		t.Fatal(err)
	}
	c, err := js.Consumer(ctx, "EVENTS", "invoicing")
	if err != nil {
		t.Fatal(err)
	}
	origCons := c.CachedInfo().Config
	changedCons := origCons
	changedCons.MaxDeliver = 1
	if _, err := js.UpdateConsumer(ctx, "EVENTS", changedCons); err != nil {
		t.Fatal(err)
	}
	ready(relayProc, 503, "stream EVENTS: max_msgs is 1000000, fanout's configuration says unlimited")
	ready(subs, 503, "consumer invoicing: max_deliver is 1, fanout's configuration says unlimited")
	ready(subs, 503, "stream EVENTS: max_msgs is 1000000")
	for _, c := range []struct {
		p             *process
		metric, field string
	}{
		{relayProc, `fanout_relay_config_differences{object="stream EVENTS"} 1`, "max_msgs"},
		{subs, `fanout_subscriber_config_differences{object="consumer invoicing",subscriber="invoicing"} 1`, "max_deliver"},
	} {
		if _, body := get(t, c.p.opsAddr(t), "/metrics"); !strings.Contains(body, c.metric) {
			t.Errorf("metrics lack %s", c.metric)
		}
		logged := false
		for _, line := range strings.Split(c.p.output(), "\n") {
			var l map[string]any
			if json.Unmarshal([]byte(line), &l) == nil && l["field"] == c.field && l["level"] == "ERROR" && l["have"] != nil && l["want"] != nil {
				logged = true
			}
		}
		if !logged {
			t.Errorf("no log line names %s with both values:\n%s", c.field, c.p.output())
		}
	}

	if _, err := js.UpdateStream(ctx, orig); err != nil {
		t.Fatal(err)
	}
	if _, err := js.UpdateConsumer(ctx, "EVENTS", origCons); err != nil {
		t.Fatal(err)
	}
	ready(relayProc, 200, "")
	ready(subs, 200, "")

	// The consumer deleted, then made again (it could start anywhere): both
	// are differences, until a restart binds the new one.
	if err := js.DeleteConsumer(ctx, "EVENTS", "invoicing"); err != nil {
		t.Fatal(err)
	}
	ready(subs, 503, "consumer invoicing: exists is no, fanout's configuration says yes")
	if out, err := run(t, env, "provision", "invoicing"); err != nil {
		t.Fatalf("provision: %v\n%s", err, out)
	}
	ready(subs, 503, "consumer invoicing: created is")
}
