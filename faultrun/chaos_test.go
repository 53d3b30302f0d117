package faultrun

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/example"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/orderstatus"
	"github.com/fanout/fanout/subscribers/registry"
)

// Every run has servers of its own (Postgres, Redis, nats-server, the
// proxies) and spends most of its time waiting on its fixed schedule, so
// the runs go side by side: each test and subtest here is parallel, as
// many at a time as -parallel allows (`go tool task test` runs this
// package beside the others with -parallel 3).

// TestChaos is the fault-injection run, once on a single nats-server and
// once on a three-node JetStream cluster. FANOUT_TEST_CHAOS_DURATION sets
// the load-and-faults time of each (default 40s; `go tool task chaos` runs
// 10m), FANOUT_TEST_CHAOS_SEED the fault schedule (default 1), and
// FANOUT_TEST_CHAOS_MODE=single or cluster runs one of them.
func TestChaos(t *testing.T) {
	t.Parallel()
	duration := 40 * time.Second
	if d, err := time.ParseDuration(os.Getenv("FANOUT_TEST_CHAOS_DURATION")); err == nil {
		duration = d
	}
	seed := uint64(1)
	if s, err := strconv.ParseUint(os.Getenv("FANOUT_TEST_CHAOS_SEED"), 10, 64); err == nil {
		seed = s
	}
	bin := build(t)
	for _, mode := range []string{"single", "cluster"} {
		if m := os.Getenv("FANOUT_TEST_CHAOS_MODE"); m != "" && m != mode {
			continue
		}
		// wal-transaction, poll-transaction: with relay.atomic transaction.
		for _, capture := range []string{relay.CapturePoll, relay.CaptureWAL, walTransaction, pollTransaction} {
			if c := os.Getenv("FANOUT_TEST_CHAOS_CAPTURE"); c != "" && c != capture {
				continue
			}
			t.Run(mode+"/"+capture, func(t *testing.T) {
				t.Parallel()
				atomic := ""
				switch capture {
				case walTransaction:
					capture, atomic = relay.CaptureWAL, relay.AtomicTransaction
				case pollTransaction:
					capture, atomic = relay.CapturePoll, relay.AtomicTransaction
				}
				o := Options{Duration: duration, Seed: seed, Cluster: mode == "cluster", Rate: 40, Binary: bin, Logf: t.Logf, Capture: capture, Atomic: atomic}
				if (mode == "single" && capture == relay.CapturePoll) || (mode == "cluster" && capture == relay.CaptureWAL) {
					// An event without a number takes another path through
					// the poll claim and the wal relay's aggregate order;
					// product.updated is the most written type, read by no
					// ordered subscriber.
					o.Unnumbered = []string{shop.ProductUpdated}
				}
				rep := Run(t, o)
				t.Log("\n" + rep.String())
				if !rep.Pass() {
					t.Errorf("invariant violated: %s", rep.Violations[0])
				}
			})
		}
	}
}

// walTransaction and pollTransaction name the fault run's captures with
// relay.atomic transaction (FANOUT_TEST_CHAOS_CAPTURE=wal-transaction).
const (
	walTransaction  = "wal-transaction"
	pollTransaction = "poll-transaction"
)

// build compiles the fanout binary, with extra build flags, into the
// test's temporary directory.
func build(t *testing.T, flags ...string) string {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "fanout")
	args := append(append([]string{"build"}, flags...), "-o", bin, filepath.Join(root, "cmd/fanout"))
	if out, err := exec.Command("go", args...).CombinedOutput(); err != nil {
		t.Fatalf("build fanout: %v\n%s", err, out)
	}
	return bin
}

// TestChaosSelfTest proves the checker: runs of a deliberately broken
// binary (built with the fanout_sabotage tag) must each be reported as a
// violation of the invariant the sabotage breaks. A checker that passed
// any of them would be worthless.
func TestChaosSelfTest(t *testing.T) {
	t.Parallel()
	duration := 25 * time.Second
	if d, err := time.ParseDuration(os.Getenv("FANOUT_TEST_CHAOS_SELFTEST_DURATION")); err == nil {
		duration = d
	}
	// The order status copy is in the binary's registry, so that a case
	// can make it join late; a run has the subscribers its case names.
	bin := build(t, "-tags", "fanout_sabotage,fanout_orderstatus")
	withOrderStatus, err := registry.Default.With(orderstatus.Subscriber)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		sabotage string
		capture  string
		killOnly []string
		want     string // in the first violation reported for it
		rollBack bool   // JetStream's stores rolled back during the run
		atomic   string // relay.atomic
		backfill string // a subscriber that joins late (Options.Backfill)
	}{
		// Rows marked sent without a publish: the stream lacks them.
		{"relay-skips-publish", relay.CapturePoll, []string{"relay"}, "every sent row is in the stream", false, "", ""},
		// The same in wal capture, where a published row stays pending:
		// the checker must still see the ones the stream lacks.
		{"relay-skips-publish", relay.CaptureWAL, []string{"relay"}, "every sent row is in the stream", false, "", ""},
		// Events published without waiting for their aggregate's earlier
		// ones, some of which fail and are retried: out of order.
		{"relay-unordered", relay.CapturePoll, []string{"relay"}, "each aggregate's events enter the stream in commit order", false, "", ""},
		// An ordered subscriber run unordered, with events failing for a
		// few seconds: an order's transitions applied out of order.
		{"subscriber-unordered", relay.CapturePoll, []string{"relay"}, "every order's applied history equals its committed history", false, "", ""},
		// Acked before the commit, then killed: events neither handled
		// nor dead-lettered.
		{"ack-before-commit", relay.CapturePoll, []string{"invoicing", "salesledger"}, "every event checkpointed or dead-lettered", false, "", ""},
		// An event handled twice: the ledger counts its order twice.
		{"handle-twice", relay.CapturePoll, []string{"relay"}, "sales ledger equals its order lines", false, "", ""},
		// No auditor while JetStream loses messages it acknowledged: the
		// stream lacks them for good.
		{"relay-no-audit", relay.CapturePoll, []string{"relay"}, "every sent row is in the stream", true, "", ""},
		// relay.atomic transaction, with each transaction's events
		// published in two halves: others land between them.
		{"relay-splits-transactions", relay.CaptureWAL, []string{"relay"}, "a transaction's events enter the stream together", false, relay.AtomicTransaction, ""},
		{"relay-splits-transactions", relay.CapturePoll, []string{"relay"}, "a transaction's events enter the stream together", false, relay.AtomicTransaction, ""},
		// A backfill that moves past rows it never handed to the handler:
		// orders from before the late subscriber joined lack invoices.
		{"backfill-skips-rows", relay.CapturePoll, []string{"backfill"}, "exactly one invoice per order", false, "", invoicing.Name},
		// A backfill that applies each order as its creation, over what
		// the live events brought: orders that had moved on regress.
		{"backfill-regresses", relay.CapturePoll, []string{"backfill"}, "none lost, none regressed", false, "", orderstatus.Name},
		// Product updates expected unnumbered, the outbox numbering them
		// all the same (the harness skips `fanout outbox numbering`).
		{sabotageNumberingNotSkipped, relay.CapturePoll, []string{"relay"}, "does not number has no number", false, "", ""},
	} {
		t.Run(tc.sabotage+"/"+tc.capture, func(t *testing.T) {
			t.Parallel()
			o := Options{Duration: duration, Seed: 1, Rate: 40, Binary: bin, Logf: t.Logf,
				Sabotage: tc.sabotage, KillOnly: tc.killOnly, Capture: tc.capture, RollBack: tc.rollBack, Atomic: tc.atomic}
			if tc.backfill != "" {
				o.Backfill = []string{tc.backfill}
			}
			if tc.backfill == orderstatus.Name {
				o.Subscribers = withOrderStatus.All()
			}
			if tc.sabotage == sabotageNumberingNotSkipped {
				o.Unnumbered = []string{shop.ProductUpdated}
			}
			rep := Run(t, o)
			t.Log("\n" + rep.String())
			found := false
			for _, v := range rep.Violations {
				found = found || strings.Contains(v, tc.want)
			}
			if !found {
				t.Errorf("sabotage %s: the checker did not report %q (it reported %d violations: %v)", tc.sabotage, tc.want, len(rep.Violations), rep.Violations)
			}
		})
	}
}

// TestChaosBackfill: invoicing and the order status copy (a test
// subscriber, in a binary built with the fanout_orderstatus tag) join a
// third of the way into the run, taking only new events, and their
// backfills (killed again and again, beside the run's faults) hand them
// the orders from before. Every order ends with exactly one invoice (none
// lost, none applied twice) and its copy at its latest status and version
// (none lost, none regressed); every event after they joined is in their
// checkpoints or their dead letters, and the only rows the backfills could
// not apply are the planted bad orders.
func TestChaosBackfill(t *testing.T) {
	t.Parallel()
	duration := 40 * time.Second
	if d, err := time.ParseDuration(os.Getenv("FANOUT_TEST_CHAOS_DURATION")); err == nil {
		duration = d
	}
	seed := uint64(3)
	if s, err := strconv.ParseUint(os.Getenv("FANOUT_TEST_CHAOS_SEED"), 10, 64); err == nil {
		seed = s
	}
	reg, err := registry.Default.With(orderstatus.Subscriber)
	if err != nil {
		t.Fatal(err)
	}
	rep := Run(t, Options{Duration: duration, Seed: seed, Rate: 40, Binary: build(t, "-tags", "fanout_orderstatus"), Logf: t.Logf,
		Subscribers: reg.All(), Backfill: []string{invoicing.Name, orderstatus.Name}})
	t.Log("\n" + rep.String())
	if !rep.Pass() {
		t.Errorf("invariant violated: %s", rep.Violations[0])
	}
}

// TestChaosWithANewSubscriber: a subscriber added with its package and one
// registry line (the template subscriber, in a binary built with the
// fanout_example tag) takes its place in the fault run: its processes are
// started and killed with the others, every event it wants must be in its
// checkpoint or its dead letters, and its dead letters must match the
// planted input: none, the relay failing the malformed orders planted.
func TestChaosWithANewSubscriber(t *testing.T) {
	t.Parallel()
	bin := build(t, "-tags", "fanout_example")
	reg, err := registry.Default.With(example.Subscriber)
	if err != nil {
		t.Fatal(err)
	}
	rep := Run(t, Options{Duration: 30 * time.Second, Seed: 2, Rate: 40, Binary: bin, Logf: t.Logf, Subscribers: reg.All()})
	t.Log("\n" + rep.String())
	if !rep.Pass() {
		t.Errorf("invariant violated: %s", rep.Violations[0])
	}
	// The planted malformed orders are failed by the relay (invariant 5,
	// checked by the run): none reaches the new subscriber.
	if rep.Planted[plantedMalformed] == 0 {
		t.Error("no malformed order was planted")
	}
	for kind, n := range rep.DeadLetters[example.Name] {
		t.Errorf("the new subscriber dead-lettered %d events (%s): nothing planted is for it", n, kind)
	}
}
