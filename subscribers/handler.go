package subscribers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
)

// Event is one delivered event.
type Event struct {
	ID int64 // the outbox id: the same on every delivery and publish
	// Origin is the database the event came from and its outbox epoch
	// (the Fanout-Origin header, "<system identifier>/<database>/<epoch>"):
	// with ID, the event's identity. Empty on events published before
	// events carried it, which came from this subscriber's database.
	Origin        string
	Type          string // e.g. "order.created"
	AggregateType string
	AggregateID   string
	// AggregateSeq is the event's number within its aggregate (1, 2, 3, ...
	// in commit order; the Fanout-Aggregate-Seq header), 0 for an event
	// written before numbering existed.
	AggregateSeq int64
	// AfterGap is set, for an ordered subscriber, on an event applied
	// although earlier events of its aggregate never arrived within
	// subscribers.gap_wait, and on the first event seen of an aggregate
	// whose earlier events came before the consumer began
	// (subscribers.start new or time): the handler decides what that
	// means to it.
	AfterGap  bool
	CreatedAt time.Time // the outbox row's created_at: its writer's transaction
	Payload   []byte
	Headers   nats.Header
	Subject   string
	StreamSeq uint64
	StoredAt  time.Time // when the stream stored it: its PubAck (the server's clock)
	Delivery  uint64    // 1 on the first delivery

	ckey int64 // the checkpoint key of (Origin, ID), see origin.go
}

// key is the event's checkpoint key (origin.go): its id for an event of
// this database's first epoch.
func (e Event) key() int64 {
	if e.ckey != 0 {
		return e.ckey
	}
	return e.ID
}

// Handler is a subscriber's handler of one kind, chosen where it is made
// and checked by the compiler: Tx for a handler whose effects are in
// Postgres (committed with its checkpoint), Each for one whose effects are
// outside it. A type that implements both is run as the kind its
// constructor names, never by a guess. What the subscriber is called,
// which events it wants and whether it takes them in order are its
// Declaration's to say, once.
type Handler struct {
	tx   TxHandler
	each EventHandler
}

// Tx is h as a handler whose effects commit with its checkpoint, in the
// runtime's transaction. An ordered subscriber's handler (Declaration's
// Ordered) is one: its per-aggregate checkpoint commits in the same
// transaction (see orderedcheckpoint.go).
func Tx(h TxHandler) Handler { return Handler{tx: h} }

// Each is h as a handler whose effects live outside Postgres, event by
// event (or batch by batch, for a BatchEventHandler).
func Each(h EventHandler) Handler { return Handler{each: h} }

// IsZero reports whether h was made by neither Tx nor Each.
func (h Handler) IsZero() bool { return h.tx == nil && h.each == nil }

// Unwrap returns the handler as its author wrote it, for the optional
// capabilities it may have (DependentHandler, the batch interfaces).
func (h Handler) Unwrap() any {
	if h.tx != nil {
		return h.tx
	}
	return h.each
}

// Dependencies are what the handler depends on besides Postgres, if it is
// a DependentHandler.
func (h Handler) Dependencies() []Dependency {
	if dh, ok := h.Unwrap().(DependentHandler); ok {
		return dh.Dependencies()
	}
	return nil
}

// TxHandler returns the handler if it was made by Tx.
func (h Handler) TxHandler() (TxHandler, bool) { return h.tx, h.tx != nil }

// EventHandler returns the handler if it was made by Each.
func (h Handler) EventHandler() (EventHandler, bool) { return h.each, h.each != nil }

// EventHandler handles one event whose effect lives outside Postgres (a
// cache, a search index). It must be idempotent: after a crash the runtime
// may deliver an event whose effect already happened.
type EventHandler interface {
	Handle(ctx context.Context, ev Event) error
}

// TxHandler handles one event whose effect lives in Postgres, inside tx,
// which also holds the event's checkpoint row. It must not commit or roll
// back tx.
type TxHandler interface {
	HandleTx(ctx context.Context, tx pgx.Tx, ev Event) error
}

// BatchTxHandler is a TxHandler that can also handle many events at once
// (set-based SQL instead of a round trip per event). The runtime calls
// HandleBatchTx with a batch's new events, in order; if it fails, the batch
// rolls back and each event is handled alone through HandleTx, which decides
// its fate. So HandleBatchTx may simply return an error for any batch it
// does not like.
type BatchTxHandler interface {
	TxHandler
	HandleBatchTx(ctx context.Context, tx pgx.Tx, evs []Event) error
}

// BatchEventHandler is an EventHandler that can handle many events at once
// (one bulk request instead of one per event). It returns one error per
// event, in order: nil where that event's effect happened. Each event's fate
// follows its own error, so one bad event never fails the others.
type BatchEventHandler interface {
	EventHandler
	HandleBatch(ctx context.Context, evs []Event) []error
}

// retryAfter asks for a redelivery after a delay.
type retryAfter struct {
	delay time.Duration
	err   error
}

func (r *retryAfter) Error() string {
	return fmt.Sprintf("retry after %s: %v", r.delay, r.err)
}

func (r *retryAfter) Unwrap() error { return r.err }

// RetryAfter returns an error that naks the event with the given delay. It
// is the handler's own decision ("not yet"), like river's JobSnooze: it does
// not count as a failure, so an event may be snoozed any number of times.
func RetryAfter(delay time.Duration, err error) error {
	return &retryAfter{delay: delay, err: err}
}

// permanent marks an error that no retry can fix.
type permanent struct{ err error }

func (p *permanent) Error() string { return p.err.Error() }
func (p *permanent) Unwrap() error { return p.err }

// Permanent returns an error that sends the event to the dead letters with
// err as the reason, then terminates it: a malformed payload, a reference
// to something that does not exist.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanent{err: err}
}

// IsPermanent reports whether err (or an error it wraps) is Permanent.
func IsPermanent(err error) bool {
	var p *permanent
	return errors.As(err, &p)
}

// unavailable marks an error caused by a dependency being down.
type unavailable struct {
	dependency string
	err        error
}

func (u *unavailable) Error() string { return u.dependency + " unavailable: " + u.err.Error() }
func (u *unavailable) Unwrap() error { return u.err }

// Unavailable returns an error saying that dependency (a name the handler
// declares in Dependencies, such as "redis" or "search") is down: the event
// is not at fault. The runtime stops taking new work, keeps the events in
// hand, and retries them once the dependency answers again; the attempt
// never counts towards subscribers.max_failures, however long the outage.
func Unavailable(dependency string, err error) error {
	if err == nil {
		return nil
	}
	return &unavailable{dependency: dependency, err: err}
}

// IsUnavailable reports whether err (or an error it wraps) is Unavailable,
// and names the dependency.
func IsUnavailable(err error) (dependency string, ok bool) {
	var u *unavailable
	if errors.As(err, &u) {
		return u.dependency, true
	}
	return "", false
}

// Dependency is something outside the event a handler needs in order to
// work: a database, a cache, a search engine.
type Dependency struct {
	// Name appears in logs, metrics and readiness ("redis", "search").
	Name string
	// Probe answers nil when the dependency works. It is called with a
	// short deadline, while the dependency is thought down (to learn when
	// it is back) and when a handler failed without saying why (to tell an
	// outage from a bad event). It must be cheap and must not depend on an
	// event.
	Probe func(ctx context.Context) error
}

// A handler that holds resources of its own (a background goroutine, a
// connection it opened) implements io.Closer: the runner closes it when it
// stops, after its last batch.

// DependentHandler is a Handler that names what it depends on besides
// Postgres (the runtime's own checkpoint store, always probed).
type DependentHandler interface {
	Dependencies() []Dependency
}

// retryDelay reports the delay RetryAfter asked for.
func retryDelay(err error) (time.Duration, bool) {
	var r *retryAfter
	if errors.As(err, &r) {
		return r.delay, true
	}
	return 0, false
}
