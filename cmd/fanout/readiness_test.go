package main

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/pgtest"
	"github.com/fanout/fanout/subscribers/subscribertest"
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
