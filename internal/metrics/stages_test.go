package metrics

import (
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestStageWindowQuantiles(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	s := newStageRecorder(func() time.Time { return now })
	var took []time.Duration
	for i := range 1000 {
		took = append(took, time.Duration(i+1)*time.Millisecond) // 1ms .. 1000ms
	}
	s.Observe(StageHandled, "invoicing", took...)
	ws := s.LastMinute()
	if len(ws) != 1 || ws[0].Count() != 1000 {
		t.Fatalf("windows %+v, want one of 1000 observations", ws)
	}
	// The buckets are ~40 % wide: the estimate is within a bucket.
	for _, c := range []struct{ q, want float64 }{{0.5, 0.5}, {0.99, 0.99}} {
		got := ws[0].Quantile(c.q)
		if got < c.want/1.4 || got > c.want*1.4 {
			t.Errorf("p%.0f = %.3fs, want about %.3fs", c.q*100, got, c.want)
		}
	}
	if !math.IsNaN((StageWindow{Bounds: stageBuckets, Counts: make([]uint64, len(stageBuckets)+1)}).Quantile(0.5)) {
		t.Error("an empty window has a quantile")
	}
}

// The window holds the last minute: what was observed before it is gone,
// from the report, not from the Prometheus histogram.
func TestStageWindowSlides(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	s := newStageRecorder(func() time.Time { return now })
	s.Observe(StagePublished, "", 5*time.Millisecond, 6*time.Millisecond)
	now = now.Add(30 * time.Second)
	s.Observe(StagePublished, "", 2*time.Second)
	if got := s.LastMinute()[0].Count(); got != 3 {
		t.Fatalf("30 s later: %d observations, want 3", got)
	}
	now = now.Add(40 * time.Second) // 70 s after the first two
	ws := s.LastMinute()
	if len(ws) != 1 || ws[0].Count() != 1 || ws[0].Quantile(0.5) < 1 {
		t.Fatalf("70 s later: %+v, want only the 2 s observation", ws)
	}
	now = now.Add(time.Minute)
	if ws := s.LastMinute(); len(ws) != 0 {
		t.Fatalf("a quiet minute later: %+v, want nothing", ws)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(s)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(families) != 1 || families[0].GetMetric()[0].GetHistogram().GetSampleCount() != 3 {
		t.Fatalf("histogram %v, want the 3 observations", families)
	}
}

// Instances' windows add up before the quantile is read; negative
// durations (clocks apart) count as zero.
func TestStageWindowsMerge(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	a := newStageRecorder(func() time.Time { return now })
	b := newStageRecorder(func() time.Time { return now })
	for range 99 {
		a.Observe(StageDelivered, "searchindex", time.Millisecond)
	}
	b.Observe(StageDelivered, "searchindex", -time.Second)
	for range 100 {
		b.Observe(StageDelivered, "searchindex", 10*time.Second)
	}
	w := a.LastMinute()[0]
	if err := w.Merge(b.LastMinute()[0]); err != nil {
		t.Fatal(err)
	}
	if w.Count() != 200 {
		t.Fatalf("merged %d, want 200", w.Count())
	}
	if p50 := w.Quantile(0.5); p50 > 0.002 {
		t.Errorf("p50 %.4fs, want about 1ms (100 of 200 at or under 1 ms)", p50)
	}
	if p99 := w.Quantile(0.99); p99 < 7 || p99 > 14 {
		t.Errorf("p99 %.2fs, want about 10s", p99)
	}
}

// The relay's and the subscribers' metrics share one registry's recorder
// (a second recorder would register fanout_stage_seconds twice and panic:
// deploy's TestDashboardQueriesRealMetrics registers both).
func TestStagesOfSharesOneRecorder(t *testing.T) {
	reg := prometheus.NewRegistry()
	first, second := StagesOf(reg), StagesOf(reg)
	if first != second {
		t.Fatal("two recorders for one registry")
	}
}
