package subscribers_test

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers"
	"github.com/prometheus/client_golang/prometheus"
)

// fanout_subscriber_held_aggregates counts, per ordered subscriber named,
// the aggregates held behind a dead letter (0 for one with none).
func TestHeldAggregatesMetric(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	_, err := db.Pool.Exec(context.Background(), `
INSERT INTO subscriber_aggregates (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, held_by_event, held_seq) VALUES
    ('fulfilment', 'order', '1', 1, 0, 17, 2),
    ('fulfilment', 'order', '2', 3, 2, 18, 4),
    ('fulfilment', 'order', '3', 5, 4, NULL, NULL),
    ('other', 'order', '1', 1, 0, 19, 2)`)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(subscribers.NewHeldAggregatesCollector(db.Pool, []string{"fulfilment", "billing"}, slog.New(slog.NewTextHandler(io.Discard, nil))))
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "fanout_subscriber_held_aggregates" {
			continue
		}
		for _, m := range f.GetMetric() {
			got[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
		}
	}
	if len(got) != 2 || got["fulfilment"] != 2 || got["billing"] != 0 {
		t.Errorf("held aggregates %v, want fulfilment 2 and billing 0", got)
	}
}
