package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/redistest"
	"github.com/fanout/fanout/operator"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
)

// run runs a one-shot fanout command and returns its output.
func run(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func status(t *testing.T, env []string) operator.Status {
	t.Helper()
	out, err := run(t, env, "status", "--json")
	if err != nil {
		t.Fatalf("fanout status --json: %v\n%s", err, out)
	}
	var st operator.Status
	if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &st); err != nil {
		t.Fatalf("status output: %v\n%s", err, out)
	}
	return st
}

func subscriberStatus(st operator.Status, name string) operator.SubscriberStatus {
	for _, s := range st.Subscribers {
		if s.Name == name {
			return s
		}
	}
	return operator.SubscriberStatus{}
}

// The operator's tools against a running pipeline of real processes:
// status, dead-letter list/show/redrive, retry-failed, republish, replay.
func TestOperatorCommands(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	redis := redistest.Start(t)
	sc := searchtest.Client(t, search.OpenSearch)
	alias := searchtest.Alias(t, sc)
	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + nats.URL, "FANOUT_REDIS_URL=" + redis.URL,
		"FANOUT_SEARCH_ENGINE=opensearch", "FANOUT_SEARCH_URL=" + searchtest.URL(), "FANOUT_SEARCH_ALIAS=" + alias,
		"FANOUT_LOG_FORMAT=json", "FANOUT_HTTP_ADDR=127.0.0.1:0", "FANOUT_RELAY_POLL_INTERVAL=50ms",
		"FANOUT_SUBSCRIBERS_MAX_FAILURES=3", "FANOUT_SUBSCRIBERS_RETRY_MIN=100ms",
	}
	ctx := context.Background()
	relayProc := start(t, env, "relay")
	subs := start(t, env, "subscribe", "invoicing", "cacheinval", "searchindex")

	rng := rand.New(rand.NewPCG(8, 8))
	if _, err := shop.Seed(ctx, db.Pool, 5, rng); err != nil {
		t.Fatal(err)
	}
	// A product the search mapping refuses (a sku over Lucene's term limit):
	// the indexer dead-letters its event; the cache invalidator is fine.
	var bad int64
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		p, err := shop.RandomProduct(ctx, tx, rng)
		if err != nil {
			return err
		}
		p.SKU = strings.Repeat("Z", 40000)
		bad, err = shop.CreateProduct(ctx, tx, p)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// A row that can never be published, written behind the API's back.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('product', '1', 'product updated', '{}')`); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, _, err := shop.CreateOrder(ctx, tx, "ops", []shop.OrderLine{{ProductID: bad, Quantity: 1}})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	invoices := func() int {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&n)
		return n
	}
	var st operator.Status
	subscribertest.WaitFor(t, 30*time.Second, "the pipeline to settle", func() (bool, string) {
		st = status(t, env)
		si, ci := subscriberStatus(st, "searchindex"), subscriberStatus(st, "cacheinval")
		return st.Outbox.Pending == 0 && st.Outbox.Sending == 0 && st.Outbox.Failed == 1 && si.DeadLetters == 1 &&
			si.Pending == 0 && si.AckPending == 0 && ci.Pending == 0 && ci.AckPending == 0 && invoices() == 3 &&
			// The search indexer's checkpoints follow its bulk write and
			// refresh, after the acks a loaded machine may outrun.
			si.Checkpoint >= 5, fmt.Sprintf("%+v", st)
	})
	if st.Stream.Messages != 9 || subscriberStatus(st, "invoicing").Checkpoint != 3 || subscriberStatus(st, "cacheinval").Checkpoint != 6 ||
		subscriberStatus(st, "searchindex").Checkpoint != 5 {
		t.Errorf("status: %+v; want 9 events, invoicing 3, cacheinval 6, searchindex 5 checkpointed and 1 dead letter", st)
	}
	// The relay added the outbox's first two ranges a margin above the
	// ids; the rows so far are all in outbox_default.
	if st.Outbox.Ranges != 2 || st.Outbox.SealedRanges != 0 || st.Outbox.DefaultRows != 10 {
		t.Errorf("outbox ranges: %d (%d sealed), %d rows in outbox_default; want 2 (0 sealed) and 10", st.Outbox.Ranges, st.Outbox.SealedRanges, st.Outbox.DefaultRows)
	}
	human, err := run(t, env, "status")
	if err != nil || !strings.Contains(human, "SUBSCRIBER") || !regexp.MustCompile(`searchindex\s+0\s+0\s+0\s+5\s+1`).MatchString(human) ||
		!strings.Contains(human, "ranges   2 (0 full, waiting for relay.sent_retention and an audit)  outbox_default 10 rows") {
		t.Errorf("fanout status: %v\n%s", err, human)
	}

	// The dead letter: listed, shown with its reason, redriven after the fix.
	list, err := run(t, env, "dlq", "list")
	seq := regexp.MustCompile(`(?m)^(\d+)\s+searchindex\s`).FindStringSubmatch(list)
	if err != nil || seq == nil {
		t.Fatalf("dlq list: %v\n%s", err, list)
	}
	show, err := run(t, env, "dlq", "show", seq[1])
	if err != nil || !strings.Contains(show, "immense term") || !strings.Contains(show, "Fanout-Dead-Subscriber: searchindex") {
		t.Errorf("dlq show: %v\n%s", err, show)
	}
	if out, err := run(t, env, "dlq", "redrive", seq[1], "--reason", "alice tries"); err == nil || !strings.Contains(out, "failed") {
		t.Errorf("redrive before the fix: %v\n%s; want it to fail and keep the dead letter", err, out)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE products SET sku = 'SKU-FIXED', version = version + 1 WHERE id = $1`, bad); err != nil {
		t.Fatal(err)
	}
	cacheBefore := subscriberStatus(status(t, env), "cacheinval")
	out, err := run(t, env, "dlq", "redrive", seq[1], "--reason", "sku fixed")
	if err != nil || !strings.Contains(out, "from the outbox row): handled") {
		t.Fatalf("redrive after the fix: %v\n%s", err, out)
	}
	st = status(t, env)
	if si := subscriberStatus(st, "searchindex"); si.DeadLetters != 0 || si.Checkpoint != 6 {
		t.Errorf("after the redrive: %+v; want no dead letter and the event checkpointed", si)
	}
	if ci := subscriberStatus(st, "cacheinval"); ci.Checkpoint != cacheBefore.Checkpoint || ci.Redelivered != 0 {
		t.Errorf("the redrive reached cacheinval: before %+v, after %+v", cacheBefore, ci)
	}
	// The stream denies deletes: the letter stays, resolved, until it
	// ages out; the list of letters to resolve no longer shows it.
	if list, err := run(t, env, "dlq", "list"); err != nil || !strings.Contains(list, "0 dead letters to resolve (1 resolved") {
		t.Errorf("dlq list after the redrive: %v\n%s", err, list)
	}
	var role string
	if err := db.Pool.QueryRow(ctx, `SELECT session_user`).Scan(&role); err != nil {
		t.Fatal(err)
	}
	if list, err := run(t, env, "dlq", "list", "--all"); err != nil || !strings.Contains(list, "RESOLVED: redrive by "+role+" (sku fixed)") {
		t.Errorf("dlq list --all after the redrive: %v\n%s", err, list)
	}
	var actions, handled int
	_ = db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE actor = session_user AND comment = 'sku fixed' AND action = 'redrive' AND outcome = 'handled') FROM dead_letter_actions`).Scan(&actions, &handled)
	if actions != 2 || handled != 1 {
		t.Errorf("dead_letter_actions: %d rows, %d handled redrives by %s saying why; want 2 and 1", actions, handled, role)
	}
	_ = sc.Refresh(ctx, alias)
	if docs, err := sc.MGet(ctx, alias, []string{fmt.Sprint(bad)}); err != nil || len(docs) != 1 {
		t.Errorf("the redriven product is not in the index: %v %v", docs, err)
	}

	// The failed row, fixed and retried.
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET event_type = 'product.updated', payload = jsonb_build_object('product_id', $1::bigint) WHERE status = 'failed'`, bad); err != nil {
		t.Fatal(err)
	}
	if out, err := run(t, env, "outbox", "retry-failed"); err != nil || !strings.Contains(out, "1 failed rows returned to pending") {
		t.Fatalf("retry-failed: %v\n%s", err, out)
	}
	subscribertest.WaitFor(t, 15*time.Second, "the retried row published", func() (bool, string) {
		st = status(t, env)
		return st.Outbox.Failed == 0 && st.Outbox.Pending == 0 && st.Stream.Messages == 10, fmt.Sprintf("%+v", st.Outbox)
	})

	// Republish everything sent in the last 10 minutes: JetStream drops the
	// duplicates, the checkpoints absorb the rest; no second invoice.
	if out, err := run(t, env, "outbox", "republish", "--since", "10m"); err != nil || !strings.Contains(out, "10 rows published since") {
		t.Fatalf("republish: %v\n%s", err, out)
	}
	subscribertest.WaitFor(t, 15*time.Second, "the republished rows sent", func() (bool, string) {
		st = status(t, env)
		return st.Outbox.Pending == 0 && st.Outbox.Sending == 0 && st.Outbox.Sent == 10, fmt.Sprintf("%+v", st.Outbox)
	})
	if st.Stream.Messages != 10 || invoices() != 3 {
		t.Errorf("after republish: %d messages, %d invoices; want 10 and 3", st.Stream.Messages, invoices())
	}

	// The last minute's latency by stage, read from the roles' operations
	// endpoints (http.peers) and merged.
	peers := "FANOUT_HTTP_PEERS=" + relayProc.opsAddr(t) + "," + subs.opsAddr(t)
	st = status(t, append(env, peers))
	if st.Stages == nil || len(st.Stages.Unreachable) > 0 {
		t.Fatalf("status read no stages: %+v", st.Stages)
	}
	got := map[string]operator.StageLatency{}
	for _, l := range st.Stages.Latencies {
		got[l.Stage+"/"+l.Subscriber] = l
	}
	for _, k := range []string{"commit_to_puback/", "puback_to_delivered/invoicing", "delivered_to_handled/invoicing",
		"puback_to_delivered/searchindex", "delivered_to_handled/searchindex", "handled_to_searchable/searchindex"} {
		if l := got[k]; l.Events == 0 || l.P99Ms < l.P50Ms || l.P50Ms <= 0 {
			t.Errorf("stage %s: %+v, want events with 0 < p50 <= p99", k, l)
		}
	}
	if l := got["commit_to_puback/"]; l.Events < 10 {
		t.Errorf("commit → PubAck counted %d events, want the 10 published (and the republished ones)", l.Events)
	}
	human, err = run(t, append(env, peers), "status")
	if err != nil || !strings.Contains(human, "latency by stage, last minute") || !regexp.MustCompile(`handled → searchable\s+searchindex\s+\d+`).MatchString(human) {
		t.Errorf("fanout status: %v\n%s", err, human)
	}

	// Replay invoicing from the start: it receives its 3 events again and
	// skips them; the other subscribers are untouched.
	if out, err := run(t, env, "replay", "invoicing", "--from-seq", "1", "--reason", "fill a gap"); err != nil {
		t.Fatalf("replay: %v\n%s", err, out)
	}
	// Recorded: the request with the database role that ran it, and the
	// outcome with the role of the subscriber's instance that carried it
	// out (here both are the test's role).
	var requests, moved int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE request_id IS NULL AND outcome = 'requested'),
       count(*) FILTER (WHERE request_id IS NOT NULL AND outcome = 'moved')
FROM replays WHERE subscriber = 'invoicing' AND from_seq = 1 AND actor = session_user AND comment = 'fill a gap'`).Scan(&requests, &moved); err != nil || requests != 1 || moved != 1 {
		t.Errorf("replays recorded: %d requests and %d moves (%v), want the request and its outcome", requests, moved, err)
	}
	// fanout status lists it, and what came of it.
	if st := status(t, env); len(st.Replays) != 1 || st.Replays[0].Outcome != "moved" || st.Replays[0].Subscriber != "invoicing" || st.Replays[0].Reason != "fill a gap" {
		t.Errorf("status's replays: %+v, want invoicing's, moved", st.Replays)
	}
	if human, err := run(t, env, "status"); err != nil || !regexp.MustCompile(`replay   \d+: invoicing from sequence 1 of EVENTS, asked by \S+ at .* \(fill a gap\): moved, recorded by `).MatchString(human) {
		t.Errorf("fanout status after a replay: %v\n%s", err, human)
	}
	subscribertest.WaitFor(t, 15*time.Second, "invoicing to skip the replayed events", func() (bool, string) {
		_, body := get(t, subs.opsAddr(t), "/metrics")
		return strings.Contains(body, `fanout_subscriber_skipped_duplicates_total{subscriber="invoicing"} 3`), ""
	})
	if invoices() != 3 {
		t.Errorf("%d invoices after a replay, want 3", invoices())
	}
	if out, err := run(t, env, "replay", "invoicing"); err == nil {
		t.Errorf("replay without a position succeeded: %s", out)
	}
	// By time: the stream tells the first sequence stored at or after it.
	if out, err := run(t, env, "replay", "invoicing", "--from-time", "24h"); err != nil || !strings.Contains(out, "again from sequence 1;") {
		t.Errorf("replay from a day ago: %v\n%s; want it from sequence 1", err, out)
	}
	future := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	if out, err := run(t, env, "replay", "invoicing", "--from-time", future); err == nil || !strings.Contains(out, "no event in stream EVENTS at or after") {
		t.Errorf("replay from an hour ahead: %v\n%s; want no event found", err, out)
	}
}

// Before the relay ever ran there is no stream: status says so and still
// reports the outbox.
func TestStatusBeforeTheStreamExists(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + nats.URL, "FANOUT_LOG_FORMAT=json"}
	if _, err := shop.Seed(context.Background(), db.Pool, 3, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	human, err := run(t, env, "status")
	if err != nil || !strings.Contains(human, "stream   EVENTS  not created yet") || !regexp.MustCompile(`outbox\s+pending [1-9]`).MatchString(human) {
		t.Errorf("fanout status before the relay: %v\n%s", err, human)
	}
	st := status(t, env)
	if !st.Stream.Missing || st.Stream.Name != "EVENTS" || st.Outbox.Pending == 0 {
		t.Errorf("fanout status --json before the relay: %+v; want the stream missing and the pending rows", st)
	}
}
