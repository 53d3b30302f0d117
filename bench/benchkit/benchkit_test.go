package benchkit

import (
	"slices"
	"testing"
)

func TestFigure(t *testing.T) {
	var f Figure
	for _, v := range []float64{79004, 75100, 77620} {
		f.Add(v)
	}
	if got, want := f.Format("%.0f rows/s"), "77620 rows/s (3 runs: 75100–79004)"; got != want {
		t.Errorf("Format = %q, want %q", got, want)
	}
	f.Add(80000)
	if got := f.Median(); got != (77620+79004)/2.0 {
		t.Errorf("median of 4 = %v", got)
	}
	one := Figure{Values: []float64{1.5}}
	if got := one.Format("%.1fms"); got != "1.5ms" {
		t.Errorf("one run: %q", got)
	}
}

func TestRotation(t *testing.T) {
	for round, want := range [][]int{{0, 1, 2}, {1, 2, 0}, {2, 0, 1}, {0, 1, 2}} {
		if got := Rotation(round, 3); !slices.Equal(got, want) {
			t.Errorf("round %d: %v, want %v", round, got, want)
		}
	}
}
