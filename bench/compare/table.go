package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
)

// report is a comparison's figures, side by side.
type report struct {
	labels  [2]string // what each side was built from
	rounds  int
	out     string   // the raw outputs' directory
	notes   []string // what was dropped, and why
	figures []*sampled
}

func (r *report) note(log io.Writer, format string, args ...any) {
	n := fmt.Sprintf(format, args...)
	r.notes = append(r.notes, n)
	fmt.Fprintln(log, "note:", n)
}

// add records one run's figures; figures keep the order they were first
// seen in (a program's, in its patterns' order).
func (r *report) add(program string, s side, found []measure) {
	for _, m := range found {
		f := r.find(program, m.name)
		if f == nil {
			f = &sampled{program: program, name: m.name, unit: m.unit, better: m.better}
			r.figures = append(r.figures, f)
		}
		f.values[s] = append(f.values[s], m.value)
	}
}

// find returns the named figure of a program, or nil.
func (r *report) find(program, name string) *sampled {
	i := slices.IndexFunc(r.figures, func(f *sampled) bool { return f.program == program && f.name == name })
	if i < 0 {
		return nil
	}
	return r.figures[i]
}

// ratio is the new median over the old one (NaN where a side has no
// value, or the old median is 0).
func (f *sampled) ratio() float64 {
	o, n := f.values[oldSide], f.values[newSide]
	if len(o) == 0 || len(n) == 0 || median(o) == 0 {
		return math.NaN()
	}
	return median(n) / median(o)
}

// verdict reads the two ranges (each side's lowest to highest run). On a
// host this noisy, only ranges apart are a measured difference; a run or
// two a side shows no range worth reading.
func (f *sampled) verdict() string {
	o, n := f.values[oldSide], f.values[newSide]
	switch {
	case len(o) == 0:
		return "new only"
	case len(n) == 0:
		return "old only"
	case len(o) < 2 || len(n) < 2:
		return "?"
	case slices.Max(o) >= slices.Min(n) && slices.Max(n) >= slices.Min(o):
		return "~"
	}
	if (median(n) > median(o)) == (f.better == higherIsBetter) {
		return "better"
	}
	return "worse"
}

// cell is one side's median and range: "34916 rows/s (33917–35010)".
func (f *sampled) cell(s side) string {
	v := f.values[s]
	if len(v) == 0 {
		return "—"
	}
	c := formatNumber(median(v)) + " " + f.unit
	if len(v) > 1 {
		c += fmt.Sprintf(" (%s–%s)", formatNumber(slices.Min(v)), formatNumber(slices.Max(v)))
	}
	return c
}

// median is the middle value, or the mean of the two middle ones (as
// benchkit prints a figure; this program imports none of the code it
// measures, so that a broken package of it fails the build of a side, not
// of the comparison).
func median(v []float64) float64 {
	s := slices.Sorted(slices.Values(v))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// formatNumber prints three or four significant digits, more for large
// numbers: 34916, 120.5, 8.12, 0.861.
func formatNumber(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1000:
		return fmt.Sprintf("%.0f", v)
	case a >= 100:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3f", v)
	}
}

// print writes the comparison, a table per program, as benchstat does.
func (r *report) print(w io.Writer) {
	fmt.Fprintf(w, "\nold: %s\nnew: %s\n", r.labels[oldSide], r.labels[newSide])
	fmt.Fprintf(w, "%d round(s); in each, every part ran once on each side (-runs 1), old and new back to back, the first of them alternating from round to round\n", r.rounds)
	fmt.Fprintf(w, "raw outputs: %s\n", r.out)
	for _, n := range r.notes {
		fmt.Fprintln(w, "note:", n)
	}
	var programs []string
	for _, f := range r.figures {
		if !slices.Contains(programs, f.program) {
			programs = append(programs, f.program)
		}
	}
	for _, p := range programs {
		fmt.Fprintf(w, "\n%s\n", p)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  figure\tbetter\told: median (range)\tnew: median (range)\tnew/old\t")
		for _, f := range r.figures {
			if f.program != p {
				continue
			}
			ratio := "—"
			if q := f.ratio(); !math.IsNaN(q) {
				ratio = fmt.Sprintf("%.3f", q)
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\n", f.name, f.better, f.cell(oldSide), f.cell(newSide), ratio, f.verdict())
		}
		tw.Flush()
	}
	if len(r.figures) == 0 {
		fmt.Fprintln(w, "\nno figures were found in the runs' outputs: read them in", r.out)
	}
	fmt.Fprint(w, strings.Join([]string{
		"",
		"~       the old and new ranges overlap: not a measured difference",
		"better  the ranges are apart, and new is better (\"better\" says which way is)",
		"worse   the ranges are apart, and new is worse",
		"?       a side has a single run: no range to judge by (use ROUNDS=3 or more)",
		"",
	}, "\n"))
}
