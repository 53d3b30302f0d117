package subscribers

// The stall watchdog: a subscriber with events waiting that settles none
// (acks, retries or dead-letters none) for subscribers.stall_after is not
// ready, and says why.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// stallWatch knows when the runner last settled an event (acked, naked for
// a retry, or sent to the dead letters) and whether it is stalled.
type stallWatch struct {
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

// watchdogLoop checks, every tenth of stall_after, whether the runner
// finished anything while events waited; it logs when a stall begins and
// ends. A dependency that is down is not a stall: readiness names it, and
// the events are held for it on purpose.
func (r *Runner) watchdogLoop(ctx context.Context) {
	every := max(r.cfg.StallAfter/10, 100*time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := r.checkStall(ctx)
		r.stall.mu.Lock()
		was := r.stall.stalled
		r.stall.stalled = err
		r.stall.mu.Unlock()
		switch {
		case err != nil && was == nil:
			r.logger.Error("subscriber stalled: events wait and none is settled", "error", err)
			r.obs.Stalled(r.name, true)
		case err == nil && was != nil:
			r.logger.Info("subscriber no longer stalled")
			r.obs.Stalled(r.name, false)
		}
	}
}

// checkStall returns why the runner is stalled, or nil (also when it
// cannot tell: the consumer's state unreadable is NATS's outage, which its
// own check reports). The stall clock runs from the later of the last
// finished event and the moment events began to wait (seen within a tick).
func (r *Runner) checkStall(ctx context.Context) error {
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	info, err := r.cons.Info(ictx)
	if err != nil {
		return nil
	}
	waiting := info.NumPending + uint64(info.NumAckPending)
	if waiting == 0 {
		r.stall.waitingSince = time.Time{}
		return nil
	}
	if r.stall.waitingSince.IsZero() {
		r.stall.waitingSince = time.Now()
	}
	if r.health.ready() != nil {
		// Held for an outage on purpose; once it ends, the clock starts
		// afresh.
		r.stall.waitingSince = time.Now()
		return nil
	}
	idle := min(r.stall.idle(), time.Since(r.stall.waitingSince))
	if idle < r.cfg.StallAfter {
		return nil
	}
	return fmt.Errorf("subscriber %s: stalled: %d events waiting (%d not yet delivered, %d delivered and not acknowledged) and none settled (acked, retried or dead-lettered) for %s (subscribers.stall_after %s): a handler that never returns, or a consumer that delivers nothing",
		r.name, waiting, info.NumPending, info.NumAckPending, idle.Round(time.Second), r.cfg.StallAfter)
}
