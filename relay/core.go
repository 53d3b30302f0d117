package relay

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/semaphore"
)

// core is what every part of a relay shares: its settings and
// connections, the rows it holds in flight, and its stop and wake-up
// signals. The parts (the claim loop, the sweeper, the transaction
// delivery, the wal capture, the auditor, the maintainer) each embed it;
// the relay owns it and starts and stops them.
type core struct {
	cfg    Config
	stream stream.Config
	pool   *pgxpool.Pool
	store  *outboxstore.Store
	nc     *nats.Conn
	js     jetstream.JetStream
	logger *slog.Logger
	obs    Observer
	hooks  testhooks.Relay // zero but in tests (internal/testhooks)

	// origin stamps and guards every publish with the database's identity
	// (origin.go).
	origin *originGuard

	wake     chan struct{}
	stopping chan struct{}       // closed by Stop: claim no more
	slots    *semaphore.Weighted // rows claimed and not yet recorded
	batches  sync.WaitGroup      // deliveries in flight
	loops    sync.WaitGroup      // the parts' loops

	// lastClaimed (unix nanoseconds) is when a claim last completed, empty
	// or not (in wal capture: the last contact with the slot), and
	// lastClaimErr the error of the last one that failed: readiness reads
	// them, with no query of its own.
	lastClaimed  atomic.Int64
	lastClaimErr atomic.Pointer[string]
	unrecorded   atomic.Int64 // rows claimed and handed to deliveries, not yet recorded
}

// nudge wakes the claim loop, as a writer's notification does.
func (c *core) nudge() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// sleep waits for d, a wake-up or a stop; it returns false on stop.
func (c *core) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.wake:
		return true
	case <-c.stopping:
		return false
	case <-ctx.Done():
		return false
	}
}

// isStopping says whether Stop was called.
func (c *core) isStopping() bool {
	select {
	case <-c.stopping:
		return true
	default:
		return false
	}
}

// touch records contact with the source (a claim, the slot), for readiness.
func (c *core) touch() { c.lastClaimed.Store(time.Now().UnixNano()) }

// claimFailed records and logs a claim's error and waits errWait before
// the next claim, doubling it for the time after; it returns false if
// the relay stopped meanwhile.
func (c *core) claimFailed(softCtx context.Context, what string, err error, errWait *time.Duration) bool {
	msg := err.Error()
	c.lastClaimErr.Store(&msg)
	c.origin.markStale() // Postgres may be back from a restore
	c.logger.Error(what, "error", err, "retry_in", *errWait)
	if !c.sleep(softCtx, *errWait) {
		return false
	}
	*errWait = min(*errWait*2, max(c.cfg.PollInterval, time.Second))
	return true
}
