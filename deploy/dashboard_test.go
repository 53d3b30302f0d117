package deploy_test

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/prometheus/client_golang/prometheus"
)

// registered returns the names of every metric fanout registers.
func registered(t *testing.T) map[string]bool {
	reg := prometheus.NewRegistry()
	r := relay.NewMetrics(reg)
	s := subscribers.NewMetrics(reg)
	b := searchindex.NewBulkItems(reg)
	// Touch each vector so that Gather reports it.
	r.Published([]relay.Published{{CreatedAt: time.Now(), AckedAt: time.Now()}})
	r.Claimed(1, time.Millisecond)
	s.Handled("x", 1, time.Millisecond)
	s.Skipped("x", 1)
	s.Retried("x", 1)
	s.DeadLettered("x", 1)
	s.Stalled("x", false)
	b.BulkItem("ok")
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, f := range families {
		names[f.GetName()] = true
		if f.GetType().String() == "HISTOGRAM" {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				names[f.GetName()+suffix] = true
			}
		}
	}
	// The scrape-time collectors.
	for _, n := range []string{"fanout_outbox_backlog_rows", "fanout_outbox_oldest_pending_age_seconds", "fanout_outbox_failed_rows",
		"fanout_subscriber_pending_events", "fanout_subscriber_ack_pending_events", "fanout_subscriber_redelivered_events",
		"fanout_subscriber_held_aggregates"} {
		names[n] = true
	}
	return names
}

// Every metric the Grafana dashboard queries exists.
func TestDashboardQueriesRealMetrics(t *testing.T) {
	raw, err := os.ReadFile("grafana/fanout-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	names := registered(t)
	metric := regexp.MustCompile(`fanout_[a-z_]+`)
	seen := 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			for _, m := range metric.FindAllString(tg.Expr, -1) {
				seen++
				if !names[m] {
					t.Errorf("panel %q queries %s, which fanout does not export", p.Title, m)
				}
			}
		}
	}
	if seen < 10 {
		t.Errorf("the dashboard queries only %d metrics", seen)
	}
	for _, want := range []string{"backlog", "oldest", "Publish rate", "latency", "lag", "Dead letters"} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("the dashboard has no panel about %q", want)
		}
	}
}
