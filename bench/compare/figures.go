package main

import (
	"regexp"
	"slices"
	"strconv"
)

// direction says which way a figure improves.
type direction int

const (
	higherIsBetter direction = iota + 1
	lowerIsBetter
)

func (d direction) String() string {
	if d == lowerIsBetter {
		return "lower"
	}
	return "higher"
}

// figurePattern reads figures out of a benchmark program's text: each match
// of re is one figure, its number in the group "value", named name with
// ${label} (or any other named group) taken from the match. The programs
// print a figure as its median, then, with more than one run, its range in
// parentheses; the compared runs are -runs 1, so the median is the run's
// value either way.
//
// Patterns hold on to what the output's wording has kept across versions
// (the part's "(a)" prefix, the unit after the number) rather than whole
// sentences: "(a) fanout relay (relay.capture poll) draining 200000 rows:
// 34916 rows/s; a claim took ..." gives the poll drain, with or without
// the CPU line that followed it from 9d55f98 on, and so would the
// "(a) fanout relay drained 200000 rows in 5.80s: 34483 rows/s" of
// November. testdata holds outputs of 9fd5ac2 and a7e18de.
type figurePattern struct {
	name   string
	re     *regexp.Regexp
	unit   string
	better direction
}

// value is a figure's number as the programs print it.
const value = `(?P<value>[0-9]+(?:\.[0-9]+)?)`

func pattern(name, re, unit string, better direction) figurePattern {
	return figurePattern{name: name, re: regexp.MustCompile(re), unit: unit, better: better}
}

// measure is one figure of one run.
type measure struct {
	name   string
	value  float64
	unit   string
	better direction
}

// parseFigures returns the figures patterns find in out, in the patterns'
// order (a pattern with a label gives its figures in the output's order).
// A figure the output does not hold is absent, never zero; the first
// match of a name wins.
func parseFigures(patterns []figurePattern, out string) []measure {
	var found []measure
	for _, p := range patterns {
		vi := p.re.SubexpIndex("value")
		for _, m := range p.re.FindAllStringSubmatchIndex(out, -1) {
			name := string(p.re.ExpandString(nil, p.name, out, m))
			if slices.ContainsFunc(found, func(f measure) bool { return f.name == name }) {
				continue
			}
			v, err := strconv.ParseFloat(out[m[2*vi]:m[2*vi+1]], 64)
			if err != nil {
				continue // the regexp admits only numbers; never here
			}
			found = append(found, measure{name: name, value: v, unit: p.unit, better: p.better})
		}
	}
	return found
}

// throughputPart reads a throughput part of bench:relay: its rate, the
// first number before unit on the line "(a) ...", then extra, then, if
// cpu, the figures of the "CPU a row" line printed under it since
// 9d55f98.
func throughputPart(part, name, unit string, cpu bool, extra ...figurePattern) []figurePattern {
	line := `(?m)^\(` + part + `\) [^\n]*`
	patterns := append([]figurePattern{pattern("("+part+") "+name, line+`?`+value+` `+unit, unit, higherIsBetter)}, extra...)
	if !cpu {
		return patterns
	}
	head := line + `\n +CPU a row: `
	return append(patterns,
		pattern("("+part+") CPU a row: this process", head+`this process `+value+`µs`, "µs", lowerIsBetter),
		pattern("("+part+") CPU a row: nats-server", head+`[^\n]*nats-server `+value+`µs`, "µs", lowerIsBetter),
		pattern("("+part+") CPU a row: Postgres", head+`[^\n]*Postgres `+value+`µs`, "µs", lowerIsBetter))
}

// relayFigures are bench:relay's figures; the horizon's time series,
// retention and bigtx parts are left to their raw outputs.
var relayFigures = slices.Concat(
	throughputPart("a", "poll drain", "rows/s", true,
		pattern("(a) mean claim time", `(?m)^\(a\) [^\n]*a claim took `+value+`ms`, "ms", lowerIsBetter)),
	throughputPart("w", "wal drain", "rows/s", true),
	throughputPart("b", "naive publisher", "rows/s", false),
	throughputPart("c", "raw publish", "msgs/s", true),
	throughputPart("m", "raw publish of the relay's messages", "msgs/s", true),
	throughputPart("f", "fast-ingest batch", "msgs/s", true),
	[]figurePattern{
		// Within one run of parts a, w, c and m together.
		pattern("ceilings: a/c", `(?m)^    ceilings: a/c = `+value, "x", higherIsBetter),
		pattern("ceilings: w/c", `(?m)^    ceilings: [^\n]*?w/c = `+value, "x", higherIsBetter),
		// Writer cost: a line per variant, "    <variant>   5910 tx/s[, 53% of alone]".
		pattern("writer: ${label}", `(?m)^    (?P<label>\S[^\n]*?) +`+value+` tx/s`, "tx/s", higherIsBetter),
		pattern("writer: ${label}, of alone", `(?m)^    (?P<label>\S[^\n]*?) +[0-9.]+ tx/s[^\n]*?, `+value+`%[^\n]* of alone`, "%", higherIsBetter),
		// Latency: the variant's line, then "p50 1.23ms  p99 4.56ms  max ...".
		pattern("latency ${label}: p50", `(?m)^    (?P<label>fanout default|relay\.listen=false|relay\.capture=wal)[^\n]*\n +p50 `+value+`ms`, "ms", lowerIsBetter),
		pattern("latency ${label}: p99", `(?m)^    (?P<label>fanout default|relay\.listen=false|relay\.capture=wal)[^\n]*\n +p50 [^\n]*?p99 `+value+`ms`, "ms", lowerIsBetter),
		// Held horizon: each capture's phases, then its "held/before" line.
		pattern("horizon ${label}: held/before published/s", `(?m)^    relay\.capture=(?P<label>poll|wal)[^\n]*\n(?:        [^\n]*\n)*?        held/before: published/s `+value, "x", higherIsBetter),
		pattern("horizon ${label}: held/before p99", `(?m)^    relay\.capture=(?P<label>poll|wal)[^\n]*\n(?:        [^\n]*\n)*?        held/before: published/s [^\n]*?p99 `+value, "x", lowerIsBetter),
		pattern("(audit) drain, ${label}", `(?m)^\(audit\) drain of [0-9]+ rows, (?P<label>[^:\n]+): `+value+` rows/s`, "rows/s", higherIsBetter),
		pattern("(audit) drain, ${label}, against off", `(?m)^\(audit\) drain of [0-9]+ rows, (?P<label>[^:\n]+): [^\n]*against off `+value, "x", higherIsBetter),
		pattern("(audit) full audit", `(?m)^\(audit\) audit of [0-9]+ published rows[^:\n]*: `+value+` s`, "s", lowerIsBetter),
		pattern("(fsync) ${label}: drain", `(?m)^\(fsync\) (?P<label>sync_interval [^:\n]+): drain of [0-9]+ rows `+value+` rows/s`, "rows/s", higherIsBetter),
		// The production layout: "(accounts) ...: the poll relay as user
		// relay (service import) 29297 rows/s, in the stream's account
		// 32557 rows/s: 0.89", then the raw publishes' line.
		pattern("(accounts) drain through the import", `(?m)^\(accounts\) [^\n]*\(service import\) `+value+` rows/s`, "rows/s", higherIsBetter),
		pattern("(accounts) drain in the stream's account", `(?m)^\(accounts\) [^\n]*in the stream's account `+value+` rows/s`, "rows/s", higherIsBetter),
		pattern("(accounts) drain, import/account", `(?m)^\(accounts\) [^\n]*in the stream's account [0-9]+ rows/s(?: \([^)\n]*\))?: `+value, "x", higherIsBetter),
		pattern("(accounts) raw publish through the import", `(?m)^ +raw JetStream async publish through the import `+value+` msgs/s`, "msgs/s", higherIsBetter),
		pattern("(accounts) raw publish in the account", `(?m)^ +raw JetStream async publish through the import [^\n]*, in the account `+value+` msgs/s`, "msgs/s", higherIsBetter),
		pattern("(fsync) ${label}: raw publish", `(?m)^\(fsync\) (?P<label>sync_interval [^:\n]+): [^\n]*raw async publish `+value+` msgs/s`, "msgs/s", higherIsBetter),
	},
)

// eventsPerSecond reads the summary lines of bench:subscribers and
// bench:ordering: "<variant, from the line's start>   9239 events/s". The
// per-round and warm-up lines are indented, so they are not read.
var eventsPerSecond = pattern("${label}", `(?m)^(?P<label>\S[^\n]*?) +`+value+` events/s`, "events/s", higherIsBetter)

var subscriberFigures = []figurePattern{
	eventsPerSecond,
	pattern("invoicing 1 instance / baseline", `(?m)^ +1 instance / baseline = `+value+`x`, "x", higherIsBetter),
	pattern("invoicing 2 instances / 1 instance", `(?m)^ +1 instance / baseline = [^\n]*2 instances / 1 instance = `+value+`x`, "x", higherIsBetter),
}

var orderingFigures = []figurePattern{
	eventsPerSecond,
	pattern("ordered / unordered, 1 instance", `(?m)^ +ordered / unordered: 1 instance `+value, "x", higherIsBetter),
	pattern("ordered / unordered, 2 instances", `(?m)^ +ordered / unordered: [^\n]*2 instances `+value, "x", higherIsBetter),
}

var searchFigures = []figurePattern{
	pattern("bulk load", `(?m)^    `+value+` docs/s[^\n]*? end to end; loader peak RSS`, "docs/s", higherIsBetter),
	pattern("bulk load: loader peak RSS", `(?m)^    [^\n]* end to end; loader peak RSS `+value+` MB`, "MB", lowerIsBetter),
	pattern("steady indexing, ${label} instance(s)", `(?m)^    (?P<label>[0-9]+) instance\(s\): `+value+` events/s`, "events/s", higherIsBetter),
	pattern("steady indexing, 2 instances / 1", `(?m)^    2 instances / 1 = `+value+`x`, "x", higherIsBetter),
	pattern("freshness, commit → searchable: p50", `(?m)^    commit → searchable: p50 `+value+`ms`, "ms", lowerIsBetter),
	pattern("freshness, commit → searchable: p99", `(?m)^    commit → searchable: [^\n]*?p99 `+value+`ms`, "ms", lowerIsBetter),
	pattern("freshness, stage ${label}: p50", `(?m)^        (?P<label>\S+) +p50 `+value+`ms`, "ms", lowerIsBetter),
	pattern("freshness, stage ${label}: p99", `(?m)^        (?P<label>\S+) +p50 [^\n]*?p99 `+value+`ms`, "ms", lowerIsBetter),
}

var backfillFigures = []figurePattern{
	pattern("backfill", `(?m)^backfill, [^\n]*? `+value+` rows/s`, "rows/s", higherIsBetter),
	pattern("live freshness, no backfill: p50", `(?m)^live freshness at [0-9]+ orders/s, no backfill +p50 `+value+` ms`, "ms", lowerIsBetter),
	pattern("live freshness, no backfill: p99", `(?m)^live freshness at [0-9]+ orders/s, no backfill +[^\n]*?p99 `+value+` ms`, "ms", lowerIsBetter),
	pattern("live freshness during the backfill: p50", `(?m)^live freshness during the backfill +p50 `+value+` ms`, "ms", lowerIsBetter),
	pattern("live freshness during the backfill: p99", `(?m)^live freshness during the backfill +[^\n]*?p99 `+value+` ms`, "ms", lowerIsBetter),
	pattern("p99 during / p99 quiet", `(?m)^ +p99 during / p99 quiet = `+value+`x`, "x", lowerIsBetter),
}
