package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestComparisonFindsAPlantedSlowdown proves the comparison on a known
// answer: old is the working tree, new the same tree built with the tag
// fanout_planted_slowdown (the relay spends about 50 µs more CPU on each
// row's message, relay/planted_slowdown_on.go). Two rounds of the poll
// drain against the local services must report new/old below 0.9: the
// drain's three processes use 70 to 120 µs of CPU a row on 2 cores, and
// the planted 50 µs read 0.62 (11,932 rows/s against 7,335). It needs
// Postgres and nats-server (go tool task services), and fails, never
// skips, without them.
func TestComparisonFindsAPlantedSlowdown(t *testing.T) {
	// Generous bounds: in CI this runs beside every other package and the
	// fault runs, on a machine whose caches may be empty (the builds), and a
	// drain that reads 12,000 rows/s alone read 3,200 there.
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Minute)
	defer cancel()
	o := options{
		ref:        ".",
		parts:      "relay:a",
		rounds:     2,
		args:       "-rows 10000",
		tags:       [2]string{"", "fanout_planted_slowdown"},
		out:        t.TempDir(),
		runTimeout: 6 * time.Minute,
		log:        t.Output(),
	}
	rep, err := compare(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	var table strings.Builder
	rep.print(&table)
	t.Log(table.String())

	drain := rep.find("relay", "(a) poll drain")
	if drain == nil {
		t.Fatalf("no poll drain figure in the runs' outputs (%s)", o.out)
	}
	for _, s := range sides {
		if n := len(drain.values[s]); n != o.rounds {
			t.Fatalf("%s: %d poll drain values, want one a round (%d)", s, n, o.rounds)
		}
	}
	if r := drain.ratio(); !(r < 0.9) {
		t.Fatalf("poll drain new/old = %.3f, want below 0.9: the comparison missed a planted slowdown of 50 µs a row", r)
	}
	// Each run's output is kept for a person to check the parse by.
	raw, err := filepath.Glob(filepath.Join(o.out, "relay-a.round*.txt"))
	if err != nil || len(raw) != 2*o.rounds {
		t.Fatalf("raw outputs %v (%v), want %d", raw, err, 2*o.rounds)
	}
	if b, err := os.ReadFile(raw[0]); err != nil || !strings.Contains(string(b), "(a) fanout relay") {
		t.Fatalf("raw output %s does not hold the drain's line (%v)", raw[0], err)
	}
}
