package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/events"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/semaphore"
)

// publisher turns claimed rows into messages and publishes them: each
// on its own, their PubAcks awaited together (publishAll), or chains of
// them as atomic batches (atomic.go). Every part that publishes goes
// through it, so every publish is guarded by the database's identity and
// built by the same rules.
type publisher struct {
	*core
	// atomicOK: the live stream allows atomic batches (the relay's stream
	// check); atomicSlots bounds those open at once.
	atomicOK    atomic.Bool
	atomicSlots *semaphore.Weighted
	// payloads applies the declared event types (Options.EventTypes).
	payloads events.Checker
}

func newPublisher(c *core, payloads events.Checker) *publisher {
	return &publisher{core: c, atomicSlots: semaphore.NewWeighted(atomicInFlight), payloads: payloads}
}

// outcome of one row's publish.
type outcome struct {
	acked     bool
	duplicate bool
	seq       uint64 // where it landed in the stream (the PubAck's; a duplicate's is the first copy's)
	ackedAt   time.Time
	permanent bool // never publishable: mark failed
	returned  bool // not published: an earlier event of its aggregate in the batch was not
	err       string
}

// publishAll publishes rows asynchronously and waits for their PubAcks, but
// never past the publish timeout. It returns each row's outcome, or false
// if ctx ended first (outcomes unknown).
func (p *publisher) publishAll(ctx context.Context, rows []row, decorate ...func(*nats.Msg)) ([]outcome, bool) {
	results := make([]outcome, len(rows))
	if err := p.origin.guard(ctx); err != nil {
		// Not the rows' fault: they back off and come back, uncounted
		// against them as any outage's are.
		for i := range results {
			results[i] = outcome{err: err.Error()}
		}
		return results, ctx.Err() == nil
	}
	futures := make([]jetstream.PubAckFuture, len(rows))
	maxPayload := p.nc.MaxPayload()
	for i, rw := range rows {
		msg, err := p.message(rw, maxPayload)
		if err != nil {
			results[i] = outcome{permanent: true, err: rowReason(rw.ID, err)}
			continue
		}
		for _, d := range decorate {
			d(msg)
		}
		if p.hooks.FailPublish != nil && p.hooks.FailPublish(rw.ID) {
			results[i] = outcome{err: "nats: no responders available for request (injected by a test hook)"}
			continue
		}
		if p.hooks.Anonymous {
			msg.Header[jetstream.MsgIDHeader] = []string{strconv.FormatInt(rw.ID, 10)}
		}
		if p.hooks.SkipPublish != nil && p.hooks.SkipPublish(rw.ID) {
			results[i] = outcome{acked: true, ackedAt: time.Now()} // a lie
			continue
		}
		// message() set Nats-Msg-Id and Nats-Expected-Stream: publish
		// options would set them again, validating each name (about a
		// twentieth of the relay's CPU in a drain, bench:relay's profile).
		f, err := p.js.PublishMsgAsync(msg)
		if err != nil {
			results[i] = classify(rw.ID, err)
			continue
		}
		futures[i] = f
	}

	deadline := time.NewTimer(p.cfg.PublishTimeout)
	defer deadline.Stop()
	timedOut := false
	for i, f := range futures {
		if f == nil {
			continue
		}
		if timedOut {
			results[i] = outcome{err: "no PubAck within relay.publish_timeout"}
			continue
		}
		select {
		case ack := <-f.Ok():
			results[i] = outcome{acked: true, duplicate: ack.Duplicate, seq: ack.Sequence, ackedAt: time.Now()}
		case err := <-f.Err():
			results[i] = classify(rows[i].ID, err)
		case <-deadline.C:
			timedOut = true
			results[i] = outcome{err: "no PubAck within relay.publish_timeout"}
		case <-ctx.Done():
			return nil, false
		}
	}
	return results, true
}

// message builds the NATS message for a row, or says why it can never be
// published. Rows are not only written through package outbox (other
// languages, plain SQL), so its rules are applied again here: whatever a row
// holds, what passes is carried by nats.go and nats-server unchanged, and
// nothing the relay sends can make the server drop its connection (which
// would stall every row, not just this one).
func (p *publisher) message(rw row, maxPayload int64) (*nats.Msg, error) {
	plantedSlowdown()
	msg, err := wire.Encode(p.stream, p.origin.identity.Load(), rw, maxPayload)
	if err != nil {
		return nil, err
	}
	if err := p.payloads.Check(rw.EventType, rw.AggregateType, rw.Payload); err != nil {
		return nil, fmt.Errorf("%w: %w", outbox.ErrInvalidEvent, err)
	}
	return msg, nil
}

// jsErrCodeHeaderTooLarge is JetStream's "header size exceeds maximum
// allowed of 64k"; nats.go has no constant for it.
const jsErrCodeHeaderTooLarge jetstream.ErrorCode = 10097

// classify turns a publish error into an outcome: permanent errors are about
// the row itself and will never succeed; the rest are retried with backoff.
// message() should have refused every row that fails permanently; these
// cases catch a rule it misses, which would otherwise retry forever.
func classify(id int64, err error) outcome {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", wire.ErrEventTooLarge, err))}
	case errors.Is(err, nats.ErrBadSubject), errors.Is(err, nats.ErrBadHeaderMsg):
		return outcome{permanent: true, err: rowReason(id, err)}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", wire.ErrEventTooLarge, apiErr))}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeHeaderTooLarge:
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", wire.ErrEventTooLarge, apiErr))}
	default:
		return outcome{err: err.Error()}
	}
}

// rowReason is the last_error of a row marked failed: it names the row, so
// that the reason stands alone in a log line or an operator's query.
func rowReason(id int64, err error) string {
	return fmt.Sprintf("outbox row %d: %v", id, err)
}
