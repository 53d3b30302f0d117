package metrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ScrapeFresh is how long the figures a collector read from Postgres or
// NATS answer scrapes before it reads them again.
const ScrapeFresh = 5 * time.Second

// Cached wraps a collector that queries Postgres or NATS when scraped:
// /metrics has no authentication, and however often it is asked the
// queries run at most once per fresh. Scrapes in between get the last
// figures; scrapes that arrive during a read wait for it.
func Cached(c prometheus.Collector, fresh time.Duration) prometheus.Collector {
	return &cachedCollector{inner: c, fresh: fresh}
}

type cachedCollector struct {
	inner prometheus.Collector
	fresh time.Duration

	mu   sync.Mutex
	at   time.Time // when last read (zero: never)
	last []prometheus.Metric
}

func (c *cachedCollector) Describe(ch chan<- *prometheus.Desc) { c.inner.Describe(ch) }

func (c *cachedCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() || time.Since(c.at) >= c.fresh {
		read := make(chan prometheus.Metric)
		done := make(chan struct{})
		var fresh []prometheus.Metric
		go func() {
			defer close(done)
			for m := range read {
				fresh = append(fresh, m)
			}
		}()
		c.inner.Collect(read)
		close(read)
		<-done
		c.last, c.at = fresh, time.Now()
	}
	for _, m := range c.last {
		ch <- m
	}
}
