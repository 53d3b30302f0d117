package subscribers

// The stall watchdog: a subscriber with events waiting that settles none
// (acks, retries or dead-letters none) for subscribers.stall_after is not
// ready, and says why.

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// stallWatch knows when the runner last settled an event (acked, naked for
// a retry, or sent to the dead letters) and whether it is stalled.
type stallWatch struct {
	name   string
	after  time.Duration // subscribers.stall_after
	logger *slog.Logger
	obs    Observer
	// cons and health are the runner's, from its start.
	cons   jetstream.Consumer
	health *Health

	last atomic.Int64 // Unix nanoseconds
	// waitingSince is when the watchdog first saw events waiting (zero
	// while none wait); only the watchdog's goroutine uses it.
	waitingSince time.Time

	mu      sync.Mutex
	stalled error
}

// finished records that events were finished now.
func (w *stallWatch) finished() { w.last.Store(time.Now().UnixNano()) }

// idle is how long ago events were last finished (or the runner started).
func (w *stallWatch) idle() time.Duration { return time.Since(time.Unix(0, w.last.Load())) }

// err is why the runner is stalled, or nil.
func (w *stallWatch) err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stalled
}

// loop checks, every tenth of stall_after, whether the runner finished
// anything while events waited; it logs when a stall begins and ends. A
// dependency that is down is not a stall: readiness names it, and the
// events are held for it on purpose.
func (w *stallWatch) loop(ctx context.Context) {
	every := max(w.after/10, 100*time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := w.check(ctx)
		w.mu.Lock()
		was := w.stalled
		w.stalled = err
		w.mu.Unlock()
		switch {
		case err != nil && was == nil:
			w.logger.Error("subscriber stalled: events wait and none is settled", "error", err)
			w.obs.Stalled(w.name, true)
		case err == nil && was != nil:
			w.logger.Info("subscriber no longer stalled")
			w.obs.Stalled(w.name, false)
		}
	}
}

// check returns why the runner is stalled, or nil (also when it
// cannot tell: the consumer's state unreadable is NATS's outage, which its
// own check reports). The stall clock runs from the later of the last
// finished event and the moment events began to wait (seen within a tick).
func (w *stallWatch) check(ctx context.Context) error {
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	info, err := w.cons.Info(ictx)
	if err != nil {
		return nil
	}
	waiting := info.NumPending + uint64(info.NumAckPending)
	if waiting == 0 {
		w.waitingSince = time.Time{}
		return nil
	}
	if w.waitingSince.IsZero() {
		w.waitingSince = time.Now()
	}
	if w.health.ready() != nil {
		// Held for an outage on purpose; once it ends, the clock starts
		// afresh.
		w.waitingSince = time.Now()
		return nil
	}
	idle := min(w.idle(), time.Since(w.waitingSince))
	if idle < w.after {
		return nil
	}
	return fmt.Errorf("subscriber %s: stalled: %d events waiting (%d not yet delivered, %d delivered and not acknowledged) and none settled (acked, retried or dead-lettered) for %s (subscribers.stall_after %s): a handler that never returns, or a consumer that delivers nothing",
		w.name, waiting, info.NumPending, info.NumAckPending, idle.Round(time.Second), w.after)
}
