package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

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
func (r *Relay) publishAll(ctx context.Context, rows []row, decorate ...func(*nats.Msg)) ([]outcome, bool) {
	results := make([]outcome, len(rows))
	if err := r.guardOrigin(ctx); err != nil {
		// Not the rows' fault: they back off and come back, uncounted
		// against them as any outage's are.
		for i := range results {
			results[i] = outcome{err: err.Error()}
		}
		return results, ctx.Err() == nil
	}
	futures := make([]jetstream.PubAckFuture, len(rows))
	maxPayload := r.nc.MaxPayload()
	for i, rw := range rows {
		msg, err := r.message(rw, maxPayload)
		if err != nil {
			results[i] = outcome{permanent: true, err: rowReason(rw.ID, err)}
			continue
		}
		for _, d := range decorate {
			d(msg)
		}
		if r.hooks.FailPublish != nil && r.hooks.FailPublish(rw.ID) {
			results[i] = outcome{err: "nats: no responders available for request (injected by a test hook)"}
			continue
		}
		if r.hooks.Anonymous {
			msg.Header[jetstream.MsgIDHeader] = []string{strconv.FormatInt(rw.ID, 10)}
		}
		if r.hooks.SkipPublish != nil && r.hooks.SkipPublish(rw.ID) {
			results[i] = outcome{acked: true, ackedAt: time.Now()} // a lie
			continue
		}
		// message() set Nats-Msg-Id and Nats-Expected-Stream: publish
		// options would set them again, validating each name (about a
		// twentieth of the relay's CPU in a drain, bench:relay's profile).
		f, err := r.js.PublishMsgAsync(msg)
		if err != nil {
			results[i] = classify(rw.ID, err)
			continue
		}
		futures[i] = f
	}

	deadline := time.NewTimer(r.cfg.PublishTimeout)
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
func (r *Relay) message(rw row, maxPayload int64) (*nats.Msg, error) {
	return Message(r.stream, r.identity.Load(), rw, maxPayload)
}

// Message is the NATS message the relay publishes for the outbox row rw
// of the database ident into the stream cfg, or why it never can be (see
// Relay.message): the operator tools read an event from its row through
// it, exactly as the relay published it.
func Message(cfg stream.Config, ident *outbox.Identity, rw outbox.Claimed, maxPayload int64) (*nats.Msg, error) {
	if err := outbox.ValidEventType(rw.EventType); err != nil {
		return nil, err
	}
	if err := outbox.ValidateAggregate(rw.AggregateType, rw.AggregateID); err != nil {
		return nil, err
	}
	if !rw.CreatedAt.Valid {
		return nil, fmt.Errorf("%w: created_at is not a readable point in time", outbox.ErrInvalidEvent)
	}
	if rw.CreatedAt.InfinityModifier != pgtype.Finite {
		return nil, fmt.Errorf("%w: created_at is %s, not a point in time", outbox.ErrInvalidEvent, rw.CreatedAt.InfinityModifier)
	}
	headers, err := decodeHeaders(rw.Headers)
	if err != nil {
		return nil, err
	}
	msg := &nats.Msg{
		Subject: stream.Subject(cfg.SubjectPrefix, rw.EventType),
		Data:    rw.Payload,
		Header:  make(nats.Header, len(headers)+10),
	}
	// Every header has one value: one array holds them all, rather than an
	// allocation per header for every event.
	values := make([]string, 0, len(headers)+10)
	set := func(k, v string) {
		values = append(values, v)
		msg.Header[k] = values[len(values)-1 : len(values) : len(values)]
	}
	// ValidateHeaders refused the names the relay sets below, so a
	// writer's header never replaces one of them.
	for k, v := range headers {
		set(k, v)
	}
	id := strconv.FormatInt(rw.ID, 10)
	origin := ident.OriginOf(rw.ID)
	// The keys are constants already in canonical form: no Set needed.
	set(outbox.EventIDHeader, id)
	set(outbox.OriginHeader, origin)
	set(outbox.EventTypeHeader, rw.EventType)
	set(outbox.AggregateTypeHeader, rw.AggregateType)
	set(outbox.AggregateIDHeader, rw.AggregateID)
	set(outbox.CreatedAtHeader, rw.CreatedAt.Time.UTC().Format(time.RFC3339Nano))
	if rw.AggregateSeq.Valid {
		set(outbox.AggregateSeqHeader, strconv.FormatInt(rw.AggregateSeq.Int64, 10))
	}
	// JetStream's own: the id it drops duplicates by (the event's whole
	// identity: another database's event with the same id is another
	// event), and the stream the event must land in (publishAll passes no
	// publish options).
	if rw.LandedSeq > 0 {
		set(outbox.RepairedHeader, strconv.FormatUint(rw.LandedSeq, 10))
	}
	set(jetstream.MsgIDHeader, origin+":"+id)
	set(jetstream.ExpectedStreamHeader, cfg.Name)
	hdr := msg.Size() - len(msg.Subject) - len(msg.Data)
	if hdr > math.MaxUint16 {
		// JetStream refuses a larger header block (error 10097). The
		// outbox limits keep rows far below it; this guards the sum.
		return nil, fmt.Errorf("%w: the headers are %d bytes, over JetStream's limit of %d", ErrEventTooLarge, hdr, math.MaxUint16)
	}
	if size := int64(hdr + len(msg.Data)); maxPayload > 0 && size > maxPayload {
		return nil, fmt.Errorf("%w: event is %d bytes with headers, over the server's max_payload of %d bytes", ErrEventTooLarge, size, maxPayload)
	}
	return msg, nil
}

// ErrEventTooLarge is the reason given for rows over the server's max_payload
// or JetStream's limit on headers.
var ErrEventTooLarge = errors.New("event too large")

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
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", ErrEventTooLarge, err))}
	case errors.Is(err, nats.ErrBadSubject), errors.Is(err, nats.ErrBadHeaderMsg):
		return outcome{permanent: true, err: rowReason(id, err)}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", ErrEventTooLarge, apiErr))}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeHeaderTooLarge:
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", ErrEventTooLarge, apiErr))}
	default:
		return outcome{err: err.Error()}
	}
}

// rowReason is the last_error of a row marked failed: it names the row, so
// that the reason stands alone in a log line or an operator's query.
func rowReason(id int64, err error) string {
	return fmt.Sprintf("outbox row %d: %v", id, err)
}
