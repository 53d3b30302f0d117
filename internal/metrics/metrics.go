// Package metrics is the Prometheus plumbing every role shares: the
// registry, the latency buckets, and the stage latencies of an event's way
// (stages.go). The metrics themselves live with what they measure: the
// relay's in relay/metrics.go, the subscriber runtime's in
// subscribers/metrics.go, each a decorator around the small observer
// interface its package reports through, never counters sprinkled
// through the code.
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// NewRegistry returns a registry with the Go runtime and process metrics.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// LatencyBuckets span 1 ms to about 30 s.
var LatencyBuckets = prometheus.ExponentialBuckets(0.001, 2, 16)

// ScrapeTimeout bounds the queries a collector runs on each scrape.
const ScrapeTimeout = 3 * time.Second
