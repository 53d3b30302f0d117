package outbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/events"
	"github.com/jackc/pgx/v5"
)

// Event is one domain event, as a writer describes it.
type Event struct {
	// AggregateType and AggregateID name the entity the event is about,
	// for example "product" and "42". Both are required and travel as
	// header values (see ValidateAggregate).
	AggregateType string
	AggregateID   string
	// Type is the event type, for example "product.updated". It becomes the
	// subject <prefix>.<Type>, so each dot-separated token must be a valid
	// NATS subject token, and it is at most MaxEventTypeLen bytes long (see
	// ValidEventType).
	Type string
	// Payload is the message body. []byte and json.RawMessage must hold
	// valid JSON and are stored as given; anything else is marshaled.
	Payload any
	// Headers travel as NATS message headers, for example the W3C
	// "traceparent". Optional. Names starting with Nats- or Fanout- are
	// reserved, and names and values must survive the wire unchanged (see
	// ValidateHeaders).
	Headers map[string]string
}

// WakeChannel is the Postgres NOTIFY channel on which writers wake the relay.
const WakeChannel = "fanout_outbox"

// ErrInvalidEvent is wrapped by every error Write or Queue returns for an
// event that can never be published, and by the validators' errors.
var ErrInvalidEvent = errors.New("invalid outbox event")

// DefaultWakeInterval is the default for Writer.WakeInterval.
const DefaultWakeInterval = 2 * time.Millisecond

// Writer inserts events. Its zero value is not usable; use NewWriter, or the
// package-level Write, which uses a process-wide default Writer.
//
// A Writer wakes the relay with pg_notify inside the writer's transaction,
// but at most once per WakeInterval per process. NOTIFY takes a database-wide
// lock from pre-commit to the end of the commit, so a notify in every
// transaction serializes all writers' commits (halving throughput in our
// measurements). One notify per interval keeps commits concurrent, and the
// relay needs no more: once woken it polls eagerly while rows keep coming
// (see package relay), and it always falls back to polling, so a wake-up lost
// to a rolled-back transaction costs latency, never an event.
type Writer struct {
	wakeInterval time.Duration
	lastWake     atomic.Int64 // unix nanoseconds of the last notify attempt
	// types is what each payload is checked against before it is written
	// (CheckedAgainst); its zero value checks nothing.
	types events.Checker
}

// NewWriter returns a Writer that notifies at most once per wakeInterval.
// A wakeInterval of 0 notifies in every transaction; a negative one never
// notifies (the relay then finds rows by polling alone).
func NewWriter(wakeInterval time.Duration, opts ...WriterOption) *Writer {
	w := &Writer{wakeInterval: wakeInterval}
	for _, o := range opts {
		o(w)
	}
	return w
}

// WriterOption sets what a Writer checks besides the rules every event
// meets.
type WriterOption func(*Writer)

// CheckedAgainst makes the Writer refuse an event whose payload does not
// match its type's schema in types, and an event of a type types does not
// declare, with an error wrapping ErrInvalidEvent and the catalog's own
// (an *events.InvalidPayload naming the JSON pointer and the rule, or
// events.ErrUndeclared), before anything is written.
func CheckedAgainst(types *events.Catalog) WriterOption {
	return func(w *Writer) { w.types.Types = types }
}

// AllowUndeclared makes a Writer checked against a catalog let through
// the event types the catalog does not declare: only the declared ones are
// checked.
func AllowUndeclared() WriterOption {
	return func(w *Writer) { w.types.AllowUndeclared = true }
}

// check applies the catalog, if any.
func (w *Writer) check(e Event, payload []byte) error {
	if err := w.types.Check(e.Type, e.AggregateType, payload); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidEvent, err)
	}
	return nil
}

var defaultWriter = NewWriter(DefaultWakeInterval)

// Write inserts e into the outbox inside tx, using the process-wide default
// Writer, and returns the event id. See Writer.Write.
func Write(ctx context.Context, tx pgx.Tx, e Event) (int64, error) {
	return defaultWriter.Write(ctx, tx, e)
}

const (
	insertSQL = `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ($1, $2, $3, $4, $5)
RETURNING id`

	// One round trip for the insert and the wake-up. pg_notify's void
	// result is scanned into nothing.
	insertAndWakeSQL = `
WITH inserted AS (
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
    VALUES ($1, $2, $3, $4, $5)
    RETURNING id
)
SELECT id, pg_notify('` + WakeChannel + `', '') FROM inserted`
)

// Write inserts e into the outbox inside tx and returns the event id. The
// event is published only if tx commits. An event that could never be
// published (see ValidEventType, ValidateAggregate, ValidateHeaders; a
// payload that is not valid JSON or that jsonb cannot hold), or that breaks
// the declarations the Writer is checked against, is refused with
// an error wrapping ErrInvalidEvent before anything is sent to Postgres, and
// tx is left as it was. The relay marks a row `failed` by the same rules when
// it was inserted some other way.
func (w *Writer) Write(ctx context.Context, tx pgx.Tx, e Event) (int64, error) {
	e.Headers = TraceHeaders(ctx, e.Headers)
	payload, headers, err := e.encode()
	if err != nil {
		return 0, err
	}
	if err := w.check(e, payload); err != nil {
		return 0, err
	}
	var id int64
	if w.shouldWake() {
		err = tx.QueryRow(ctx, insertAndWakeSQL, e.AggregateType, e.AggregateID, e.Type, payload, headers).Scan(&id, nil)
	} else {
		err = tx.QueryRow(ctx, insertSQL, e.AggregateType, e.AggregateID, e.Type, payload, headers).Scan(&id)
	}
	if err != nil {
		return 0, fmt.Errorf("insert outbox event %s: %w", e.Type, err)
	}
	return id, nil
}

// Queue appends the insert of e to b, a batch the caller sends inside its
// transaction with tx.SendBatch, so that the event costs no round trip of its
// own: on a small machine an extra round trip costs a short write transaction
// more than the insert itself does. When the batch's results are read, *id
// (if not nil) receives the event id. As with Write, an error from the batch
// means the transaction must not commit.
//
// Queue has no context, so it cannot pick up the caller's span: set
// Headers to TraceHeaders(ctx, ...) yourself, as the shop writers do.
func (w *Writer) Queue(b *pgx.Batch, e Event, id *int64) error {
	payload, headers, err := e.encode()
	if err != nil {
		return err
	}
	if err := w.check(e, payload); err != nil {
		return err
	}
	query, dest := insertSQL, []any{new(int64)}
	if w.shouldWake() {
		query, dest = insertAndWakeSQL, []any{dest[0], nil}
	}
	scan := func(row pgx.Row) error {
		if err := row.Scan(dest...); err != nil {
			return fmt.Errorf("insert outbox event %s: %w", e.Type, err)
		}
		if id != nil {
			*id = *dest[0].(*int64)
		}
		return nil
	}
	b.Queue(query, e.AggregateType, e.AggregateID, e.Type, payload, headers).QueryRow(scan)
	return nil
}

// Queue appends e to b using the process-wide default Writer. See
// Writer.Queue.
func Queue(b *pgx.Batch, e Event, id *int64) error {
	return defaultWriter.Queue(b, e, id)
}

func (w *Writer) shouldWake() bool {
	if w.wakeInterval < 0 {
		return false
	}
	now := time.Now().UnixNano()
	last := w.lastWake.Load()
	if now-last < int64(w.wakeInterval) {
		return false
	}
	// One writer per interval wins; the others skip.
	return w.lastWake.CompareAndSwap(last, now)
}

func (e Event) encode() (payload, headers []byte, err error) {
	if err := ValidEventType(e.Type); err != nil {
		return nil, nil, err
	}
	if err := ValidateAggregate(e.AggregateType, e.AggregateID); err != nil {
		return nil, nil, fmt.Errorf("event %s: %w", e.Type, err)
	}
	switch p := e.Payload.(type) {
	case nil:
		return nil, nil, fmt.Errorf("%w: event %s has no payload", ErrInvalidEvent, e.Type)
	case []byte:
		payload = p
	case json.RawMessage:
		payload = p
	default:
		if payload, err = json.Marshal(p); err != nil {
			return nil, nil, fmt.Errorf("%w: marshal payload of %s: %v", ErrInvalidEvent, e.Type, err)
		}
	}
	if !json.Valid(payload) {
		return nil, nil, fmt.Errorf("%w: payload of %s is not valid JSON", ErrInvalidEvent, e.Type)
	}
	if hasNULEscape(payload) {
		// Postgres refuses the insert, which would abort the caller's
		// transaction; refusing here leaves it usable.
		return nil, nil, fmt.Errorf("%w: payload of %s contains \\u0000, which a Postgres jsonb value cannot hold", ErrInvalidEvent, e.Type)
	}
	if len(e.Headers) == 0 {
		return payload, emptyHeaders, nil
	}
	if err := ValidateHeaders(e.Headers); err != nil {
		return nil, nil, fmt.Errorf("event %s: %w", e.Type, err)
	}
	if headers, err = json.Marshal(e.Headers); err != nil {
		return nil, nil, fmt.Errorf("%w: marshal headers of %s: %v", ErrInvalidEvent, e.Type, err)
	}
	return payload, headers, nil
}

// emptyHeaders is the headers column of most events, shared so that they
// cost no allocation. Never modified: pgx only reads a parameter.
var emptyHeaders = []byte("{}")

// hasNULEscape reports whether the JSON text p holds the escape \u0000 (a
// NUL character in a string), which jsonb rejects. Its backslash must not
// itself be escaped: "\\u0000" is a backslash followed by "u0000".
func hasNULEscape(p []byte) bool {
	const esc = `\u0000`
	for i := 0; ; {
		j := bytes.Index(p[i:], []byte(esc))
		if j < 0 {
			return false
		}
		j += i
		backslashes := 0
		for k := j - 1; k >= 0 && p[k] == '\\'; k-- {
			backslashes++
		}
		if backslashes%2 == 0 {
			return true
		}
		i = j + len(esc)
	}
}
