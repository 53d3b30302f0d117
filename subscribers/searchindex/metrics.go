package searchindex

import "github.com/prometheus/client_golang/prometheus"

// BulkItems counts search bulk item outcomes (ok, conflict, not_found,
// retry, failed, rejected: see Handler.ObserveBulkItems).
type BulkItems struct{ items *prometheus.CounterVec }

// NewBulkItems registers the search indexer's bulk metrics.
func NewBulkItems(reg prometheus.Registerer) *BulkItems {
	m := &BulkItems{items: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "fanout", Subsystem: "search",
		Name: "bulk_items_total", Help: "Search bulk items by outcome."}, []string{"outcome"})}
	reg.MustRegister(m.items)
	return m
}

// BulkItem counts one item.
func (m *BulkItems) BulkItem(outcome string) { m.items.WithLabelValues(outcome).Inc() }
