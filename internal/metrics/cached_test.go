package metrics

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// gauge is the value of the one gauge reg gathers.
func gauge(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil || len(families) != 1 || len(families[0].Metric) != 1 {
		t.Errorf("gathered %v (%v), want one gauge", families, err)
		return -1
	}
	return families[0].Metric[0].GetGauge().GetValue()
}

// queried stands for a collector that reads Postgres on each scrape.
type queried struct {
	runs atomic.Int32
	desc *prometheus.Desc
}

func (q *queried) Describe(ch chan<- *prometheus.Desc) { ch <- q.desc }
func (q *queried) Collect(ch chan<- prometheus.Metric) {
	n := q.runs.Add(1)
	time.Sleep(20 * time.Millisecond) // a round trip, so that scrapes overlap it
	ch <- prometheus.MustNewConstMetric(q.desc, prometheus.GaugeValue, float64(n))
}

// /metrics is unauthenticated: a burst of scrapes reads once, and each
// gets the figures; a scrape after they went stale reads again.
func TestCachedCollectorQueriesOnceWhileFresh(t *testing.T) {
	q := &queried{desc: prometheus.NewDesc("fanout_test_backlog_rows", "test", nil, nil)}
	reg := prometheus.NewRegistry()
	reg.MustRegister(Cached(q, 300*time.Millisecond))
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			if v := gauge(t, reg); v != 1 {
				t.Errorf("a scrape read %v, want the one query's figure", v)
			}
		})
	}
	wg.Wait()
	if n := q.runs.Load(); n != 1 {
		t.Errorf("20 scrapes at once queried %d times, want 1", n)
	}
	time.Sleep(400 * time.Millisecond)
	if v := gauge(t, reg); v != 2 {
		t.Errorf("a scrape after the figures went stale read %v, want a second query's", v)
	}
}
