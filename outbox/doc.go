// Package outbox is the writer side of fanout: one call that records a
// domain event inside the caller's own Postgres transaction.
//
// The event commits or rolls back with the business rows it describes, so a
// rolled-back transaction publishes nothing and a committed one is published
// by the relay (package relay) however often processes die. Writers name the
// event, never its subscribers: who listens is decided by each subscriber's
// subject filter, so adding a subscriber changes no writer.
//
// The event's outbox id is its identity everywhere downstream: the JetStream
// Nats-Msg-Id (so JetStream drops a second publish of the same row) and the
// key of every subscriber's processed-events checkpoint.
//
// An event that could never be published is refused up front, with an error
// wrapping ErrInvalidEvent, before anything reaches Postgres: an event type
// that is not a valid subject or is longer than MaxEventTypeLen, an
// aggregate type or id that cannot be a header value, headers NATS would
// reject, change or act on (see ValidateHeaders), a payload that is not JSON
// or that jsonb cannot hold. The relay applies the same validators to every
// row it claims, since rows may also be written without this package, and
// marks a row that fails them `failed`.
//
// What happens to a row after its commit (the relays' claims and marks,
// retention, the audit's records, the operators' repairs) is package
// outboxstore's: writers need none of it.
package outbox
