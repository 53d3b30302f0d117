package benchkit

import (
	"context"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Pace is writers at a steady rate, as the freshness and latency runs
// have them.
type Pace struct {
	Workers, Rate int
	Seed          uint64 // of each worker's random source, with its number
	Staggered     bool   // the workers start interval/Workers apart, not together
}

// Run has the workers call write, together Rate times a second (each at
// a steady interval), until ctx ends. write is given the worker's number,
// how many calls it had before, and the worker's own random source, so
// that every run writes alike.
func (p Pace) Run(ctx context.Context, write func(w, i int, rng *rand.Rand)) {
	interval := time.Second * time.Duration(p.Workers) / time.Duration(p.Rate)
	var wg sync.WaitGroup
	for w := range p.Workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), p.Seed))
			next := time.Now()
			if p.Staggered {
				next = next.Add(time.Duration(w) * interval / time.Duration(p.Workers))
			}
			for i := 0; ctx.Err() == nil; i++ {
				time.Sleep(time.Until(next))
				next = next.Add(interval)
				write(w, i, rng)
			}
		})
	}
	wg.Wait()
}

// Pending times writes from their commit to their being seen (an
// invoice, a search hit): writers note each write's key as it commits, a
// watcher the keys it sees. Safe for concurrent use.
type Pending struct {
	mu  sync.Mutex
	at  map[int64]time.Time // key -> commit time
	lat []time.Duration
}

// NewPending returns an empty Pending.
func NewPending() *Pending { return &Pending{at: map[int64]time.Time{}} }

// Committed notes that key's write committed now.
func (p *Pending) Committed(key int64) {
	now := time.Now()
	p.mu.Lock()
	p.at[key] = now
	p.mu.Unlock()
}

// Keys returns the keys not yet seen, in order.
func (p *Pending) Keys() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Sorted(maps.Keys(p.at))
}

// Seen records the latency of each key still pending, seen at now.
func (p *Pending) Seen(now time.Time, keys ...int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, k := range keys {
		if c, ok := p.at[k]; ok {
			p.lat = append(p.lat, now.Sub(c))
			delete(p.at, k)
		}
	}
}

// Take returns the latencies recorded since the last Take.
func (p *Pending) Take() []time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	lat := p.lat
	p.lat = nil
	return lat
}

// Unseen is how many keys are still pending.
func (p *Pending) Unseen() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.at)
}
