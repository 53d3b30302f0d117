package main

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// program is one benchmark program under bench/ that can be compared.
type program struct {
	name    string // its directory under bench/, and its name in PARTS
	figures []figurePattern
}

var programs = []program{
	{"relay", relayFigures},
	{"subscribers", subscriberFigures},
	{"search", searchFigures},
	{"backfill", backfillFigures},
	{"ordering", orderingFigures},
}

// selection is one word of PARTS: a program, and the parts of it to run
// (none: the whole program, as `go tool task bench:<name>` runs it).
type selection struct {
	program program
	parts   []string
}

// parsePlan reads PARTS: programs separated by spaces, each optionally
// followed by a colon and a comma-separated list of its -only parts, as in
// "relay:a,w,latency subscribers".
func parsePlan(parts string) ([]selection, error) {
	var plan []selection
	for _, word := range strings.Fields(parts) {
		name, list, hasParts := strings.Cut(word, ":")
		i := slices.IndexFunc(programs, func(p program) bool { return p.name == name })
		if i < 0 {
			return nil, fmt.Errorf("PARTS: no benchmark program %q (want one of %s)", name, programNames())
		}
		if slices.ContainsFunc(plan, func(s selection) bool { return s.program.name == name }) {
			return nil, fmt.Errorf("PARTS: %s named twice (list its parts once: %s:a,b)", name, name)
		}
		s := selection{program: programs[i]}
		if hasParts {
			for _, part := range strings.Split(list, ",") {
				if part == "" || slices.Contains(s.parts, part) {
					return nil, fmt.Errorf("PARTS: %q: an empty or repeated part", word)
				}
				s.parts = append(s.parts, part)
			}
		}
		plan = append(plan, s)
	}
	if len(plan) == 0 {
		return nil, fmt.Errorf("PARTS is empty: name programs, as in PARTS='relay:a,w subscribers' (programs: %s)", programNames())
	}
	return plan, nil
}

func programNames() string {
	var names []string
	for _, p := range programs {
		names = append(names, p.name)
	}
	return strings.Join(names, ", ")
}

// flagHelp is what a benchmark binary's -h says of one flag.
type flagHelp struct {
	takesValue bool // "-rows int"; a boolean flag shows no type
	usage      string
}

var (
	helpFlagLine  = regexp.MustCompile(`^  -(\S+)(?: (\S+))?(?:\t(.*))?$`)
	helpUsageLine = regexp.MustCompile(`^    \t(.*)$`)
)

// parseHelp reads the flags of a Go program's -h (flag.PrintDefaults's
// layout: "  -name type" then its usage on lines indented by a tab).
func parseHelp(out string) map[string]flagHelp {
	flags := map[string]flagHelp{}
	var last string
	for line := range strings.Lines(out) {
		line = strings.TrimRight(line, "\n")
		if m := helpFlagLine.FindStringSubmatch(line); m != nil {
			last = m[1]
			flags[last] = flagHelp{takesValue: m[2] != "", usage: m[3]}
			continue
		}
		if m := helpUsageLine.FindStringSubmatch(line); m != nil && last != "" {
			f := flags[last]
			f.usage = strings.TrimSpace(f.usage + " " + m[1])
			flags[last] = f
		}
	}
	return flags
}

var parenthesized = regexp.MustCompile(`\([^)]*\)`)

// onlyParts reads the parts a -only usage lists: "run only this part: a,
// w, b" (9fd5ac2) or "run only these parts (a comma-separated list): a, w;
// only when asked: f (fast-ingest batches), bigtx" (since); nil if it
// names none.
func onlyParts(usage string) []string {
	_, list, ok := strings.Cut(parenthesized.ReplaceAllString(usage, ""), ":")
	if !ok {
		return nil
	}
	var parts []string
	for _, piece := range strings.FieldsFunc(list, func(r rune) bool { return r == ',' || r == ';' }) {
		if i := strings.LastIndex(piece, ":"); i >= 0 {
			piece = piece[i+1:] // "only when asked: f"
		}
		if words := strings.Fields(piece); len(words) == 1 {
			parts = append(parts, words[0])
		}
	}
	return parts
}

// cliFlag is one flag of ARGS with its value, as the tokens to pass on.
type cliFlag struct {
	name   string
	tokens []string
}

// splitArgs groups ARGS into flags. Whether "-rows 50000" is one flag with
// a value or a flag and a stray word is what the binaries' help says of
// -rows; a flag none of them knows is an error (a typo would otherwise
// quietly measure the defaults).
func splitArgs(args []string, helps []map[string]flagHelp) ([]cliFlag, error) {
	lookup := func(name string) (flagHelp, bool) {
		for _, h := range helps {
			if f, ok := h[name]; ok {
				return f, true
			}
		}
		return flagHelp{}, false
	}
	var flags []cliFlag
	for i := 0; i < len(args); i++ {
		tok := args[i]
		if !strings.HasPrefix(tok, "-") || tok == "-" || tok == "--" {
			return nil, fmt.Errorf("ARGS: %q is not a flag (ARGS holds flags for the benchmark programs, as -rows 50000)", tok)
		}
		name, _, hasValue := strings.Cut(strings.TrimLeft(tok, "-"), "=")
		if name == "runs" || name == "only" {
			return nil, fmt.Errorf("ARGS: -%s is bench:compare's to set (ROUNDS, PARTS)", name)
		}
		help, ok := lookup(name)
		if !ok {
			return nil, fmt.Errorf("ARGS: no compared benchmark program knows -%s", name)
		}
		f := cliFlag{name: name, tokens: []string{tok}}
		if help.takesValue && !hasValue {
			if i+1 == len(args) {
				return nil, fmt.Errorf("ARGS: -%s needs a value", name)
			}
			i++
			f.tokens = append(f.tokens, args[i])
		}
		flags = append(flags, f)
	}
	return flags, nil
}
