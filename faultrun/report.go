package faultrun

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// Report is what a run found.
type Report struct {
	Mode         string
	Seed         uint64
	Duration     time.Duration
	Writes       int64 // committed writer transactions
	FailedWrites int64 // failed ones (Postgres restarts)
	// Bulk repricings committed (transactions of every product's price,
	// over 1000 events each), and their events.
	Bulk, BulkEvents int64
	Planted          map[string]int
	Faults           map[string]int
	Events           uint64 // in the stream
	OutboxRows       int64
	FailedRows       int64
	// The outbox's ranges at the end (added and sealed under the faults),
	// and the rows no range holds.
	Ranges, SealedRanges int
	DefaultRows          int64
	// Aggregates whose events the stream holds, each checked to be in
	// commit order (invariant 8).
	Aggregates int
	// Unnumbered: outbox rows of a type the outbox does not number
	// (Options.Unnumbered), each checked to carry no number.
	Unnumbered int
	// Transactions (relay.atomic transaction) checked to be in the stream
	// whole, each as one batch.
	Transactions int
	// BigTransactions: those of them over 1000 events, checked to be in
	// the stream in chunks, each one batch, in order.
	BigTransactions int
	// Repaired: events the stream lost after their PubAck that the
	// auditor, or a wal relay decoding them again, published again (a
	// rolled-back store).
	Repaired int
	// Order transitions (after created) the ordered subscriber applied,
	// its history checked against the committed one (invariant 8).
	Transitions int
	// Backfilled: rows each late subscriber's backfill applied
	// (Options.Backfill).
	Backfilled  map[string]int64
	DeadLetters map[string]map[string]int // subscriber -> planted kind (or NOT PLANTED: reason) -> letters
	// PlantedDeleted counts rejected products the load deleted before the
	// indexer reached their event: indexed as gone, no letter expected.
	PlantedDeleted int
	// Counted from every process's logs, across restarts.
	JetStreamDuplicates int64 // publishes JetStream recognized (after crashes, reaped leases)
	// AtomicStored and AtomicRefused count the relays' atomic batches
	// (stored whole, or refused or unanswered), AtomicEvents the events
	// of those stored.
	AtomicStored, AtomicRefused, AtomicEvents int64
	CheckpointSkips                           int64 // deliveries the checkpoints absorbed
	Redeliveries                              int64
	Outages                                   map[string]int // dependency -> times a subscriber instance held its events for it
	Restarts                                  int
	DrainTime                                 time.Duration
	Violations                                []string
}

func (r *Report) violate(invariant, detail string) {
	r.Violations = append(r.Violations, invariant+": "+detail)
}

// Pass reports whether every invariant held.
func (r *Report) Pass() bool { return len(r.Violations) == 0 }

func (r *Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "fanout fault-injection run: %s, %s, seed %d (replay with FANOUT_TEST_CHAOS_SEED=%d)\n", r.Mode, r.Duration, r.Seed, r.Seed)
	fmt.Fprintf(&b, "  writes: %d committed, %d failed (during faults); %d bulk repricings, %d events in all\n", r.Writes, r.FailedWrites, r.Bulk, r.BulkEvents)
	fmt.Fprintf(&b, "  planted bad input:\n")
	for _, k := range sortedKeys(r.Planted) {
		fmt.Fprintf(&b, "    %-48s %d\n", k, r.Planted[k])
	}
	total := 0
	for _, n := range r.Faults {
		total += n
	}
	fmt.Fprintf(&b, "  faults injected: %d\n", total)
	for _, k := range sortedKeys(r.Faults) {
		fmt.Fprintf(&b, "    %-48s %d\n", k, r.Faults[k])
	}
	fmt.Fprintf(&b, "  events: %d outbox rows, %d in the stream, %d failed rows; %d aggregates, each one's events checked in commit order; %d events of types not numbered\n", r.OutboxRows, r.Events, r.FailedRows, r.Aggregates, r.Unnumbered)
	if r.Transactions > 0 {
		fmt.Fprintf(&b, "  transactions (relay.atomic transaction): %d checked to be in the stream as one batch each (%d over 1000 events: in chunks of 1000, each one batch, in order)\n", r.Transactions, r.BigTransactions)
	}
	if r.Repaired > 0 {
		fmt.Fprintf(&b, "  lost by JetStream after their PubAck and published again (by the auditor, or by a wal relay decoding them again): %d events\n", r.Repaired)
	}
	fmt.Fprintf(&b, "  orders: %d transitions after created applied by the ordered subscriber, its history checked against the committed one\n", r.Transitions)
	for _, name := range sortedKeys(r.Backfilled) {
		fmt.Fprintf(&b, "  backfill: %d rows from Postgres for %s, which joined late, its state checked against Postgres\n", r.Backfilled[name], name)
	}
	fmt.Fprintf(&b, "  outbox ranges at the end: %d (%d sealed), %d rows in outbox_default\n", r.Ranges, r.SealedRanges, r.DefaultRows)
	letters := 0
	for _, byKind := range r.DeadLetters {
		for _, n := range byKind {
			letters += n
		}
	}
	fmt.Fprintf(&b, "  dead letters: %d, by subscriber and reason (an outage must add none):\n", letters)
	if r.PlantedDeleted > 0 {
		fmt.Fprintf(&b, "    (%d rejected products deleted by the load before the indexer reached them: indexed as gone, no letter due)\n", r.PlantedDeleted)
	}
	for _, s := range sortedKeys(r.DeadLetters) {
		for _, k := range sortedKeys(r.DeadLetters[s]) {
			fmt.Fprintf(&b, "    %-12s %-52s %d\n", s, k, r.DeadLetters[s][k])
		}
	}
	fmt.Fprintf(&b, "  duplicates absorbed: %d by JetStream (publishes it already had), %d by the checkpoints; %d redeliveries\n",
		r.JetStreamDuplicates, r.CheckpointSkips, r.Redeliveries)
	fmt.Fprintf(&b, "  atomic batches: %d stored (%d events), %d refused or unanswered (their events went again)\n",
		r.AtomicStored, r.AtomicEvents, r.AtomicRefused)
	fmt.Fprintf(&b, "  outages waited out by subscriber instances (events held, none counted against them):")
	for _, k := range sortedKeys(r.Outages) {
		fmt.Fprintf(&b, " %s %d", k, r.Outages[k])
	}
	fmt.Fprintf(&b, "\n")
	fmt.Fprintf(&b, "  time to drain after the faults stopped: %s\n", r.DrainTime.Round(100*time.Millisecond))
	if r.Pass() {
		fmt.Fprintf(&b, "PASS: every invariant held\n")
	} else {
		fmt.Fprintf(&b, "FAIL: %s\n", r.Violations[0])
		for _, v := range r.Violations[1:] {
			fmt.Fprintf(&b, "  also: %s\n", v)
		}
	}
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// outageLogLine is the runtime's log message when a dependency goes down.
const outageLogLine = "dependency unavailable: holding the events in hand and taking no new ones until it answers"

// collectCounters sums the debug batch lines of every process's log, over
// all its incarnations.
func (r *run) collectCounters() {
	for _, role := range r.roles {
		r.report.Restarts += role.restarts
		f, err := os.Open(filepath.Join(r.logDir, role.Name+".log"))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var line struct {
				Msg         string `json:"msg"`
				Duplicates  int64  `json:"duplicates"`
				Skipped     int64  `json:"skipped"`
				Redelivered int64  `json:"redelivered"`
				Dependency  string `json:"dependency"`
				Events      int64  `json:"events"`
				Refused     bool   `json:"refused"`
			}
			if json.Unmarshal(sc.Bytes(), &line) != nil {
				continue
			}
			switch line.Msg {
			case "batch recorded":
				r.report.JetStreamDuplicates += line.Duplicates
			case "atomic batch":
				if line.Refused {
					r.report.AtomicRefused++
				} else {
					r.report.AtomicStored++
					r.report.AtomicEvents += line.Events
				}
			case "batch handled":
				r.report.CheckpointSkips += line.Skipped
				r.report.Redeliveries += line.Redelivered
			case outageLogLine:
				if r.report.Outages == nil {
					r.report.Outages = map[string]int{}
				}
				r.report.Outages[line.Dependency]++
			}
		}
		f.Close()
	}
}
