package wire

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// MsgID is the Nats-Msg-Id of the event with the given origin and id: its
// whole identity, so that another database's event with the same id is
// another event.
func MsgID(origin string, rowID int64) string {
	return origin + ":" + strconv.FormatInt(rowID, 10)
}

// Encode is the NATS message the relay publishes for the outbox row rw of
// the database ident into the stream cfg, or why it never can be. Rows
// are not only written through package outbox (other languages, plain
// SQL), so the writer's rules are applied here, to every row: whatever a
// row holds, what passes is carried by nats.go and nats-server unchanged,
// and nothing the relay sends can make the server drop its connection
// (which would stall every row, not just this one). The operator tools
// read an event from its row through it, exactly as the relay published
// it.
func Encode(cfg stream.Config, ident *outbox.Identity, rw outboxstore.Claimed, maxPayload int64) (*nats.Msg, error) {
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
	set(EventIDHeader, id)
	set(OriginHeader, origin)
	set(EventTypeHeader, rw.EventType)
	set(AggregateTypeHeader, rw.AggregateType)
	set(AggregateIDHeader, rw.AggregateID)
	set(CreatedAtHeader, rw.CreatedAt.Time.UTC().Format(time.RFC3339Nano))
	if rw.AggregateSeq.Valid {
		set(AggregateSeqHeader, strconv.FormatInt(rw.AggregateSeq.Int64, 10))
	}
	// JetStream's own: the id it drops duplicates by (the event's whole
	// identity: another database's event with the same id is another
	// event), and the stream the event must land in (the relay passes no
	// publish options).
	if rw.LandedSeq > 0 {
		set(RepairedHeader, strconv.FormatUint(rw.LandedSeq, 10))
	}
	set(jetstream.MsgIDHeader, MsgID(origin, rw.ID))
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
