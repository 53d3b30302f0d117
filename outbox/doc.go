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
package outbox
