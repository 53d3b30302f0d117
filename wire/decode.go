package wire

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/nats-io/nats.go"
)

// Event is what a message says of its event, as Decode reads it.
type Event struct {
	ID int64 // the outbox id: the same on every delivery and publish
	// Origin is the database the event came from and its outbox epoch
	// (OriginHeader); with ID, the event's identity. Empty on events
	// published before events carried it.
	Origin        string
	Type          string // e.g. "order.created"
	AggregateType string
	AggregateID   string
	// AggregateSeq is the event's number within its aggregate
	// (AggregateSeqHeader), 0 when it has none.
	AggregateSeq int64
	CreatedAt    time.Time // the outbox row's created_at: its writer's transaction
	Payload      []byte
	Headers      nats.Header
	Subject      string
}

// Decode reads an event from a message's body, headers and subject (the
// subject it was published to: a dead letter carries it in a header). A
// message without a valid event id, or with an origin that does not
// parse, is not an outbox event: whoever wrote it, it is refused with the
// reason. The type is the header's, or else the subject's last tokens.
func Decode(data []byte, h nats.Header, subject, subjectPrefix string) (Event, error) {
	ev := Event{Payload: data, Headers: h, Subject: subject}
	ev.Type = strings.TrimPrefix(subject, subjectPrefix+".")
	idText := h.Get(EventIDHeader)
	id, err := strconv.ParseInt(idText, 10, 64)
	if err != nil || id <= 0 {
		return ev, fmt.Errorf("message carries no valid %s header (got %q): not an outbox event", EventIDHeader, idText)
	}
	ev.ID = id
	if o := h.Get(OriginHeader); o != "" {
		if _, err := outbox.ParseOrigin(o); err != nil {
			return ev, fmt.Errorf("message carries a bad %s header: %w", OriginHeader, err)
		}
		ev.Origin = o
	}
	if t := h.Get(EventTypeHeader); t != "" {
		ev.Type = t
	}
	ev.AggregateType = h.Get(AggregateTypeHeader)
	ev.AggregateID = h.Get(AggregateIDHeader)
	if seq, err := strconv.ParseInt(h.Get(AggregateSeqHeader), 10, 64); err == nil && seq > 0 {
		ev.AggregateSeq = seq
	}
	ev.CreatedAt, _ = time.Parse(time.RFC3339Nano, h.Get(CreatedAtHeader))
	return ev, nil
}
