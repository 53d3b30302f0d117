package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func readHelp(t *testing.T, file string) map[string]flagHelp {
	t.Helper()
	out, err := os.ReadFile(filepath.Join("testdata", file))
	if err != nil {
		t.Fatal(err)
	}
	return parseHelp(string(out))
}

// TestOldAndNewFlags reads the -h of bench/relay at 9fd5ac2 (-only takes
// one part of eight) and at a7e18de (a list, with parts only run when
// named, and -relaylog).
func TestOldAndNewFlags(t *testing.T) {
	old, cur := readHelp(t, "relay-9fd5ac2.help"), readHelp(t, "relay-a7e18de.help")
	if got, want := onlyParts(old["only"].usage), []string{"a", "w", "b", "c", "writer", "latency", "horizon", "retention"}; !slices.Equal(got, want) {
		t.Errorf("9fd5ac2's parts %q, want %q", got, want)
	}
	want := []string{"a", "w", "b", "c", "m", "writer", "latency", "horizon", "audit", "fsync", "retention", "f", "accounts", "auditfull", "bigtx"}
	if got := onlyParts(cur["only"].usage); !slices.Equal(got, want) {
		t.Errorf("a7e18de's parts %q, want %q", got, want)
	}
	if _, ok := old["relaylog"]; ok {
		t.Error("9fd5ac2 has no -relaylog")
	}
	if !cur["relaylog"].takesValue || !cur["rows"].takesValue || !old["runs"].takesValue {
		t.Error("-relaylog, -rows and -runs take values")
	}

	// ARGS: -rows and its value are one flag; a flag no binary knows is
	// refused, and so are the flags bench:compare sets itself.
	flags, err := splitArgs(strings.Fields("-rows 50000 -relaylog=warn -batch 500"), []map[string]flagHelp{old, cur})
	if err != nil {
		t.Fatal(err)
	}
	if len(flags) != 3 || !slices.Equal(flags[0].tokens, []string{"-rows", "50000"}) || !slices.Equal(flags[1].tokens, []string{"-relaylog=warn"}) {
		t.Errorf("flags %+v", flags)
	}
	for _, bad := range []string{"-rowz 5", "-runs 3", "-only a", "50000", "-rows"} {
		if _, err := splitArgs(strings.Fields(bad), []map[string]flagHelp{old, cur}); err == nil {
			t.Errorf("ARGS %q: no error", bad)
		}
	}
}

func TestParsePlan(t *testing.T) {
	plan, err := parsePlan("relay:a,w,latency  subscribers")
	if err != nil {
		t.Fatal(err)
	}
	if len(plan) != 2 || plan[0].program.name != "relay" || !slices.Equal(plan[0].parts, []string{"a", "w", "latency"}) ||
		plan[1].program.name != "subscribers" || plan[1].parts != nil {
		t.Errorf("plan %+v", plan)
	}
	for _, bad := range []string{"", "relays:a", "relay:a,,w", "relay:a relay:w", "relay:a,a"} {
		if _, err := parsePlan(bad); err == nil {
			t.Errorf("PARTS %q: no error", bad)
		}
	}
}

// TestVerdict: only ranges apart are a difference, read in the figure's
// better direction.
func TestVerdict(t *testing.T) {
	cases := []struct {
		better   direction
		old, new []float64
		want     string
	}{
		{higherIsBetter, []float64{100, 110, 105}, []float64{80, 85, 90}, "worse"},
		{lowerIsBetter, []float64{100, 110, 105}, []float64{80, 85, 90}, "better"},
		{higherIsBetter, []float64{100, 110, 105}, []float64{80, 100, 90}, "~"},
		{higherIsBetter, []float64{100}, []float64{80}, "?"},
		{higherIsBetter, nil, []float64{80, 90}, "new only"},
	}
	for _, c := range cases {
		f := &sampled{better: c.better, values: [2][]float64{c.old, c.new}}
		if got := f.verdict(); got != c.want {
			t.Errorf("%v old %v new %v: %q, want %q", c.better, c.old, c.new, got, c.want)
		}
	}
}
