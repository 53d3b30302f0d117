package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// side is the old or the new code.
type side int

const (
	oldSide side = iota
	newSide
)

var sides = []side{oldSide, newSide}

func (s side) String() string { return [...]string{"old", "new"}[s] }

// options are a comparison's settings (the program's flags).
type options struct {
	ref        string        // the old side's git ref; "." is the working tree itself
	parts      string        // PARTS: which programs and parts
	rounds     int           // runs of each part and side
	args       string        // flags for every run of both sides
	tags       [2]string     // each side's build tags
	out        string        // where the raw outputs go; "" is a new temporary directory
	runTimeout time.Duration // one run of a benchmark program
	log        io.Writer     // progress and notes
}

// job is one part of one program: each round runs it once on each side.
type job struct {
	program program
	part    string // "" is the whole program
	bin     [2]string
	args    [2][]string
}

func (j job) String() string {
	if j.part == "" {
		return j.program.name
	}
	return j.program.name + " -only " + j.part
}

// compare builds both sides, runs every job o.rounds times on each, and
// returns their figures side by side. The old side's worktree is removed
// before it returns, whatever happens.
func compare(ctx context.Context, o options) (*report, error) {
	plan, err := parsePlan(o.parts)
	if err != nil {
		return nil, err
	}
	if o.rounds < 1 {
		return nil, fmt.Errorf("ROUNDS must be at least 1 (got %d)", o.rounds)
	}
	newTree, err := workingTree(ctx)
	if err != nil {
		return nil, err
	}
	oldTree := newTree
	if o.ref != "." {
		w, err := addWorktree(ctx, newTree.dir, o.ref)
		if err != nil {
			return nil, err
		}
		defer w.remove()
		oldTree = w.tree
	}
	trees := [2]tree{oldTree, newTree}
	for _, s := range sides {
		trees[s].tags = o.tags[s]
		if trees[s].tags != "" {
			trees[s].label += ", -tags " + trees[s].tags
		}
	}
	if o.out == "" {
		if o.out, err = os.MkdirTemp("", "fanout-bench-compare-"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(o.out, 0o755); err != nil {
		return nil, err
	}
	rep := &report{labels: [2]string{trees[oldSide].label, trees[newSide].label}, rounds: o.rounds, out: o.out}
	fmt.Fprintf(o.log, "bench:compare: old = %s, new = %s\nraw outputs of every run: %s\n", rep.labels[oldSide], rep.labels[newSide], o.out)
	jobs, err := prepare(ctx, o, plan, trees, rep)
	if err != nil {
		return nil, err
	}
	runLog, err := os.Create(filepath.Join(o.out, "runs.log"))
	if err != nil {
		return nil, err
	}
	defer runLog.Close()
	for round := range o.rounds {
		// Old first in the first round, new first in the second, and so
		// on: a host that speeds up or slows down over the sitting hits
		// both sides alike.
		order := sides
		if round%2 == 1 {
			order = []side{newSide, oldSide}
		}
		for _, j := range jobs {
			for _, s := range order {
				if err := runOnce(ctx, o, rep, runLog, j, s, trees[s], round); err != nil {
					return nil, err
				}
			}
		}
	}
	return rep, nil
}

// built is a selected program's binary on each side, and the flags each
// lists.
type built struct {
	sel  selection
	bin  [2]string
	help [2]map[string]flagHelp // nil for a side without the program
}

// newFirst is the order the sides are read in where the new side decides:
// its errors come first, and its flags count even where the old side has
// no such program.
var newFirst = []side{newSide, oldSide}

// prepare builds each selected program on both sides, reads their flags,
// and turns the selection into jobs with each side's arguments: a flag or
// a part one side's binary does not know is dropped there with a note.
func prepare(ctx context.Context, o options, plan []selection, trees [2]tree, rep *report) ([]job, error) {
	var ready []built
	var helps []map[string]flagHelp
	for _, sel := range plan {
		b, err := buildSides(ctx, o, sel, trees, rep)
		if err != nil {
			return nil, err
		}
		for _, s := range newFirst {
			if b.help[s] != nil {
				helps = append(helps, b.help[s])
			}
		}
		if b.help[oldSide] != nil {
			ready = append(ready, b)
		}
	}
	flags, err := splitArgs(strings.Fields(o.args), helps)
	if err != nil {
		return nil, err
	}
	var jobs []job
	for _, b := range ready {
		more, err := b.jobs(o, flags, rep)
		if err != nil {
			return nil, err
		}
		jobs = append(jobs, more...)
	}
	if len(jobs) == 0 {
		return nil, fmt.Errorf("nothing left to compare")
	}
	return jobs, nil
}

// buildSides builds the selected program on each side and reads its
// flags. An old tree without the program is noted, and the old side left
// out (its help nil); a working tree without it is an error.
func buildSides(ctx context.Context, o options, sel selection, trees [2]tree, rep *report) (built, error) {
	b := built{sel: sel}
	name := sel.program.name
	for _, s := range newFirst {
		if _, err := os.Stat(filepath.Join(trees[s].dir, "bench", name)); err != nil {
			if s == newSide {
				return b, fmt.Errorf("the working tree has no bench/%s", name)
			}
			rep.note(o.log, "the old tree (%s) has no bench/%s: not compared", trees[s].label, name)
			break
		}
		b.bin[s] = filepath.Join(o.out, "bin", s.String(), name)
		fmt.Fprintf(o.log, "building bench/%s (%s) ...\n", name, trees[s].label)
		bctx, cancel := context.WithTimeout(ctx, 20*time.Minute)
		err := build(bctx, trees[s], name, b.bin[s])
		cancel()
		if err != nil {
			return b, err
		}
		if b.help[s], err = help(ctx, b.bin[s], trees[s].dir); err != nil {
			return b, err
		}
	}
	return b, nil
}

// baseArgs are each side's arguments for every run of the program: -runs
// 1, and the flags of ARGS its binary knows.
func (b built) baseArgs(o options, flags []cliFlag, rep *report) [2][]string {
	name := b.sel.program.name
	var base [2][]string
	for _, s := range sides {
		if _, ok := b.help[s]["runs"]; ok {
			base[s] = append(base[s], "-runs", "1")
		} else {
			rep.note(o.log, "%s bench/%s has no -runs: each of its runs measures its own default number of times", s, name)
		}
	}
	for _, f := range flags {
		_, oldKnows := b.help[oldSide][f.name]
		_, newKnows := b.help[newSide][f.name]
		for _, s := range sides {
			if _, ok := b.help[s][f.name]; ok {
				base[s] = append(base[s], f.tokens...)
			} else if oldKnows || newKnows { // else the flag is another program's
				rep.note(o.log, "%s bench/%s has no -%s: dropped from its runs", s, name, f.name)
			}
		}
	}
	return base
}

// jobs are the program's jobs: one a selected part (-only), or the whole
// program. A part the old binary does not know is noted and left out.
func (b built) jobs(o options, flags []cliFlag, rep *report) ([]job, error) {
	name := b.sel.program.name
	base := b.baseArgs(o, flags, rep)
	parts := b.sel.parts
	if len(parts) == 0 {
		parts = []string{""}
	}
	var jobs []job
nextPart:
	for _, part := range parts {
		j := job{program: b.sel.program, part: part, bin: b.bin, args: base}
		for _, s := range newFirst { // the new side's errors first
			j.args[s] = slices.Clone(base[s])
			if part == "" {
				continue
			}
			only, ok := b.help[s]["only"]
			known := onlyParts(only.usage)
			switch {
			case !ok && s == newSide:
				return nil, fmt.Errorf("PARTS: bench/%s has no parts (no -only): name it alone", name)
			case known != nil && !slices.Contains(known, part) && s == newSide:
				return nil, fmt.Errorf("PARTS: bench/%s has no part %q (its parts: %s)", name, part, strings.Join(known, ", "))
			case !ok || known != nil && !slices.Contains(known, part):
				rep.note(o.log, "old bench/%s has no part %s: %s:%s not compared", name, part, name, part)
				continue nextPart
			}
			j.args[s] = append([]string{"-only", part}, j.args[s]...)
		}
		jobs = append(jobs, j)
	}
	return jobs, nil
}

// runOnce runs job j's binary of side s in its tree, keeps its output in
// the raw directory, and adds its figures to rep.
func runOnce(ctx context.Context, o options, rep *report, runLog io.Writer, j job, s side, t tree, round int) error {
	ctx, cancel := context.WithTimeout(ctx, o.runTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, j.bin[s], j.args[s]...)
	cmd.Dir = t.dir
	cmd.Env = append(os.Environ(), "GOFLAGS="+goflagsWithTags(t.tags))
	// An interrupt first, so a program that handles it can clean up what it
	// made (databases, streams); killed if it has not ended 30 s later.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 30 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	runErr := cmd.Run()
	took := time.Since(start).Round(100 * time.Millisecond)

	base := j.program.name
	if j.part != "" {
		base += "-" + j.part
	}
	base = fmt.Sprintf("%s.round%d.%s", base, round+1, s)
	if err := os.WriteFile(filepath.Join(o.out, base+".txt"), stdout.Bytes(), 0o644); err != nil {
		return err
	}
	if stderr.Len() > 0 {
		if err := os.WriteFile(filepath.Join(o.out, base+".stderr.txt"), stderr.Bytes(), 0o644); err != nil {
			return err
		}
	}
	status := "ok"
	if runErr != nil {
		status = runErr.Error()
	}
	fmt.Fprintf(runLog, "round %d %s: (cd %s && %s %s): %s, %s -> %s.txt\n", round+1, s, t.dir, j.bin[s], strings.Join(j.args[s], " "), took, status, base)
	if runErr != nil {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			runErr = fmt.Errorf("%w (not done within -run-timeout %s)", runErr, o.runTimeout)
		}
		// What it printed last says where it was (the raw files go with a
		// test's temporary directory).
		return fmt.Errorf("round %d, %s, %s: %w\nits output ended:\n%s\nits errors ended:\n%s", round+1, j, s, runErr,
			tail(stdout.String(), 20), tail(stderr.String(), 40))
	}
	found := parseFigures(j.program.figures, stdout.String())
	summary := "no figures found: check " + base + ".txt"
	if len(found) > 0 {
		summary = fmt.Sprintf("%d figures (%s %s %s)", len(found), found[0].name, formatNumber(found[0].value), found[0].unit)
	}
	fmt.Fprintf(o.log, "round %d of %d, %s, %s: %s, %s\n", round+1, o.rounds, j, s, took, summary)
	rep.add(j.program.name, s, found)
	return nil
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// sampled is one figure's values over the rounds, for each side.
type sampled struct {
	program, name, unit string
	better              direction
	values              [2][]float64 // a value a run
}
