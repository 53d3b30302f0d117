// Command compare is `go tool task bench:compare`: it measures the
// benchmark programs under bench/ at an old git ref and at the working
// tree in one sitting, alternating, and prints each figure side by side.
// This host's speed varies by a factor of two from one day to the next, so
// figures of different days cannot be compared; figures of old and new
// code taken turn about in the same minutes can.
//
// It checks the ref out in a temporary detached `git worktree` (removed on
// every way out), builds each selected program there and in the working
// tree (`go build -o`, the new side optionally with -new-tags), and runs
// each binary from its own tree, -runs 1 a run, -rounds times a side:
// old then new in the first round, new then old in the next, and so on.
// A flag (-args) or a part (-parts) the old binary's -h does not list is
// dropped there, with a note. The figures are read back from each run's
// text (figures.go) and printed with their medians and ranges, new/old,
// and whether the ranges overlap; every run's output stays in the printed
// directory.
//
//	go run ./bench/compare -ref a7e18de -parts 'relay:a,w subscribers' -rounds 3 -args '-rows 50000'
//
// -parts is the programs to run, separated by spaces, each with a colon
// and the -only parts to run of it (each part runs as its own run; a
// program named alone runs whole).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"
)

func main() {
	var o options
	flag.StringVar(&o.ref, "ref", "", "the old side: a git ref, built in a temporary worktree (\".\": the working tree itself, to measure -new-tags or the noise)")
	flag.StringVar(&o.parts, "parts", "", "programs and parts: 'relay:a,w,latency subscribers' (programs: "+programNames()+")")
	flag.IntVar(&o.rounds, "rounds", 3, "runs of each part on each side, old and new alternating")
	flag.StringVar(&o.args, "args", "", "flags for every run of both sides, as '-rows 50000' (dropped, with a note, where a binary does not know one)")
	flag.StringVar(&o.tags[oldSide], "old-tags", "", "build tags of the old side")
	flag.StringVar(&o.tags[newSide], "new-tags", "", "build tags of the new side, as fanout_planted_slowdown")
	flag.StringVar(&o.out, "out", "", "directory for the raw outputs (default: a new temporary directory)")
	flag.DurationVar(&o.runTimeout, "run-timeout", 90*time.Minute, "the longest one run of a benchmark program may take")
	flag.Parse()
	if o.ref == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: compare -ref REF -parts PARTS [-rounds N] [-args FLAGS] [-new-tags TAGS]")
		flag.PrintDefaults()
		os.Exit(2)
	}
	o.log = os.Stdout
	// An interrupt cancels the runs; compare then removes its worktree
	// before returning.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	rep, err := compare(ctx, o)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:compare:", err)
		os.Exit(1)
	}
	rep.print(os.Stdout)
	if f, err := os.Create(filepath.Join(rep.out, "table.txt")); err == nil {
		rep.print(f)
		f.Close()
	}
}
