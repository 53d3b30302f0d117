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
// goroutine runs only while writes wait; close makes the writes waiting
// searchable at once and waits for it.
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
	closed  bool
	stop    chan struct{} // closed by close
	done    sync.WaitGroup
}

func newRefresher(client *search.Client, index string, after, timeout time.Duration, logger *slog.Logger) *refresher {
	return &refresher{client: client, index: index, after: after, timeout: timeout, logger: logger, stop: make(chan struct{})}
}

// close refreshes for the writes waiting, if any, without waiting out
// their delay, and returns once the goroutine has ended.
func (r *refresher) close() {
	if r == nil {
		return
	}
	r.mu.Lock()
	if !r.closed {
		r.closed = true
		close(r.stop)
	}
	r.mu.Unlock()
	r.done.Wait()
}

// closeRefreshTimeout bounds the refresh close makes.
const closeRefreshTimeout = 2 * time.Second

// written records n writes made at at.
func (r *refresher) written(n int, at time.Time) {
	if r == nil || n == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return // stopping: the index's own refresh makes it searchable
	}
	for range n {
		r.waiting = append(r.waiting, at)
	}
	if !r.running && !r.closed {
		r.running = true
		r.done.Go(r.run)
	}
}

func (r *refresher) run() {
	for {
		r.mu.Lock()
		if len(r.waiting) == 0 {
			r.running = false
			r.mu.Unlock()
			return
		}
		first := r.waiting[0]
		r.mu.Unlock()
		wait := time.NewTimer(time.Until(first.Add(r.after)))
		select {
		case <-wait.C:
		case <-r.stop:
			wait.Stop()
		}

		// Every write recorded before the refresh starts is searchable
		// once it returns.
		r.mu.Lock()
		batch := r.waiting
		r.waiting = nil
		r.mu.Unlock()
		timeout := r.timeout
		select {
		case <-r.stop:
			// The last refresh, at close: bounded short, so that a stopping
			// runner does not wait out search.timeout on an engine in
			// trouble.
			timeout = min(timeout, closeRefreshTimeout)
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		err := r.client.Refresh(ctx, r.index)
		cancel()
		if err != nil {
			// The engine is down or the index gone: the writes become
			// searchable by the index's own refresh_interval when it can;
			// only their measurement is lost. No retry keeps this
			// goroutine alive past the writes it serves.
			r.logger.Debug("refresh after writes", "index", r.index, "writes", len(batch), "error", err)
			continue
		}
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
