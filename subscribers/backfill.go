package subscribers

// A subscriber's backfill, as its declaration states it: the table its
// state derives from and how a row becomes an event its handler takes.
// Package subscribers/backfill runs it (`fanout backfill`), and explains
// how its events merge with the live ones.

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/fanout/fanout/stream"
)

// Backfill is how a subscriber's state derives from Postgres: each row of
// Table becomes one event of type EventType.
type Backfill struct {
	// Table is the table read, in the order of Key: "orders".
	Table string
	// Key is a bigint column of Table whose values are unique and never
	// null (its primary key): the chunks are key ranges ("id").
	Key string
	// EventType is the type of the event each row becomes, one of the
	// subscriber's EventTypes: "order.created". Its handler gets it as it
	// gets a live event of that type, with the BackfillHeader set.
	EventType string
	// AggregateType is the events' aggregate type: "order".
	AggregateType string
	// AggregateID is an SQL expression over the row giving its aggregate
	// id ("id::text"); the key when empty.
	AggregateID string
	// Payload is an SQL expression over the row giving the event's payload
	// as jsonb: "jsonb_build_object('order_id', id)". Name the row, and
	// let the handler read its state (package backfill, "Merging with live
	// events").
	Payload string
}

// BackfillHeader is set on every event a backfill hands to a handler: its
// value is "<table>:<key>", the row it came from. Such an event has no
// outbox id (ID 0) and no stream sequence.
const BackfillHeader = "Fanout-Backfill"

func (b *Backfill) validate(eventTypes []string, ordered bool) error {
	var errs []error
	if !tableRE.MatchString(b.Table) {
		errs = append(errs, fmt.Errorf("backfill table %q: want a lower-case SQL name", b.Table))
	}
	if !tableRE.MatchString(b.Key) {
		errs = append(errs, fmt.Errorf("backfill key %q: want a lower-case SQL column name", b.Key))
	}
	if !slices.ContainsFunc(eventTypes, func(p string) bool { return stream.SubjectMatches(p, b.EventType) }) {
		errs = append(errs, fmt.Errorf("backfill event type %q: not one of the subscriber's event types %v", b.EventType, eventTypes))
	}
	if strings.ContainsAny(b.EventType, "*> ") || b.EventType == "" {
		errs = append(errs, fmt.Errorf("backfill event type %q: want one event type, not a pattern", b.EventType))
	}
	if b.AggregateType == "" {
		errs = append(errs, errors.New("backfill: no aggregate type"))
	}
	if strings.TrimSpace(b.Payload) == "" {
		errs = append(errs, errors.New("backfill: no payload expression"))
	}
	if ordered {
		// An ordered subscriber's per-aggregate checkpoint would have to
		// take a backfill event as the aggregate's state at its last
		// number (outbox_aggregates.last_seq, read in the chunk's
		// snapshot), and the live events at or below it as applied. Not
		// built yet: refused rather than run out of order.
		errs = append(errs, errors.New("backfill: ordered subscribers cannot declare a backfill yet"))
	}
	return errors.Join(errs...)
}
