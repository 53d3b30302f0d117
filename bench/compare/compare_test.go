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
// drain against the local services must report the relay's CPU a row
// worse, its ranges apart and new/old above 1.5 (about 25 µs a row
// without it). The drain's rate is not the judge: on a quiet machine the
// planted 50 µs read 0.62 of it (11,932 rows/s against 7,335), but on a
// loaded one (CI with empty caches, every package beside it) Postgres's
// 150 µs a row set the pace and both sides drained about 2,700 rows/s
// while the relay's CPU a row read 25 against 80 µs. It needs Postgres and
// nats-server (go tool task services), and fails, never skips, without
// them.
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

	for _, name := range []string{"(a) poll drain", "(a) CPU a row: this process"} {
		f := rep.find("relay", name)
		if f == nil {
			t.Fatalf("no %q figure in the runs' outputs (%s)", name, o.out)
		}
		for _, s := range sides {
			if n := len(f.values[s]); n != o.rounds {
				t.Fatalf("%s: %d %q values, want one a round (%d)", s, n, name, o.rounds)
			}
		}
	}
	cpu := rep.find("relay", "(a) CPU a row: this process")
	if r, v := cpu.ratio(), cpu.verdict(); !(r > 1.5) || v != "worse" {
		t.Fatalf("the relay's CPU a row new/old = %.3f (%s), want above 1.5 and worse: the comparison missed a planted slowdown of 50 µs a row", r, v)
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
