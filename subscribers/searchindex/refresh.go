package searchindex

// Making writes searchable on time, and knowing when they became so.

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/fanout/fanout/search"
)

// refresher refreshes the index a short, fixed time after the first write
// not yet searchable, so that a write waits at most that long (plus the
// refresh) instead of up to a whole refresh_interval, and many writes share
// one refresh. It reports each write's wait (write → searchable). Its
// goroutine runs only while writes wait: it needs no stopping, and leaves
// none behind once the indexer is idle.
type refresher struct {
	client  *search.Client
	index   string
	after   time.Duration
	timeout time.Duration
	logger  *slog.Logger
	// observe, if set, is told how long each write waited.
	observe func([]time.Duration)

	mu      sync.Mutex
	waiting []time.Time // when each write not yet refreshed was made
	running bool
}

// giveUpAfter bounds how long writes wait for a refresh that keeps failing
// (the engine down): they become searchable by the index's own
// refresh_interval anyway; only their measurement is dropped.
const giveUpAfter = time.Minute

// written records n writes made at at.
func (r *refresher) written(n int, at time.Time) {
	if r == nil || n == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for range n {
		r.waiting = append(r.waiting, at)
	}
	if !r.running {
		r.running = true
		go r.run()
	}
}

func (r *refresher) run() {
	backoff := r.after
	for {
		r.mu.Lock()
		if len(r.waiting) == 0 {
			r.running = false
			r.mu.Unlock()
			return
		}
		first := r.waiting[0]
		r.mu.Unlock()
		time.Sleep(time.Until(first.Add(r.after)))

		// Every write recorded before the refresh starts is searchable
		// once it returns.
		r.mu.Lock()
		batch := r.waiting
		r.waiting = nil
		r.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
		err := r.client.Refresh(ctx, r.index)
		cancel()
		if err != nil {
			now := time.Now()
			r.logger.Debug("refresh after writes", "index", r.index, "writes", len(batch), "error", err)
			r.mu.Lock()
			kept := batch[:0]
			for _, at := range batch {
				if now.Sub(at) < giveUpAfter {
					kept = append(kept, at)
				}
			}
			r.waiting = append(kept, r.waiting...)
			r.mu.Unlock()
			time.Sleep(backoff)
			backoff = min(2*backoff, 5*time.Second)
			continue
		}
		backoff = r.after
		if r.observe != nil {
			now := time.Now()
			took := make([]time.Duration, len(batch))
			for i, at := range batch {
				took[i] = now.Sub(at)
			}
			r.observe(took)
		}
	}
}
