// Package relay moves committed outbox rows onto the JetStream stream.
//
// A relay claims a batch of pending rows (FOR UPDATE SKIP LOCKED, so any
// number of relays share the table), moves them to `sending` under a lease
// (claim time plus a random token), publishes each row asynchronously with
// Nats-Msg-Id set to the row id, and marks each row `sent` only after its own
// PubAck, and only while its lease token still matches. A row whose publish
// failed goes back to `pending` with exponential backoff; a row that can
// never be published becomes `failed` with a reason naming it, and blocks
// nothing.
// A reaper returns rows whose lease expired (their relay died or stalled) to
// `pending`; since the stream's duplicates window is longer than the lease
// plus the publish timeout, a second publish of such a row is dropped by
// JetStream. A cleaner deletes sent rows after a retention period.
//
// # Poison rows
//
// Rows come from package outbox, but also from writers in other languages
// and from plain SQL, so the relay trusts nothing but the schema. The claim
// reads every column into a type that holds any value the schema allows
// (jsonb as text, created_at with its infinities) and decodes nothing: one
// undecodable row would otherwise fail the whole claim, and the batch would
// come back after every lease, forever. Each row is then judged on its own by
// the writer's rules (outbox.ValidEventType, outbox.ValidateAggregate,
// outbox.ValidateHeaders): headers must be a JSON object of strings; names
// must be HTTP tokens and not start with Nats- (JetStream acts on those:
// Nats-Expected-Last-Sequence or Nats-TTL would make the publish fail on
// every retry) or Fanout- (the relay sets those); values, the aggregate type
// and id must not hold CR, LF or other control characters; the event type
// must be a valid subject of at most outbox.MaxEventTypeLen bytes (a subject
// longer than the server's max_control_line makes it close the connection,
// and nats.go then closes it for good, stopping every row); the message must
// fit max_payload and JetStream's 64 KiB of headers. A row that breaks a rule
// is marked `failed` at its first attempt; a publish error that is about the
// row itself (classify) fails it too, rather than retrying it forever.
//
// # Waking up
//
// Writers send a NOTIFY at most once every few milliseconds per process
// (see package outbox); the relay LISTENs, and after any claim that found
// rows it polls again at once, then backs off (1ms, 2ms, 4ms, ...) up to the
// poll interval. So a steady stream of writes keeps the relay busy with
// latency of a few milliseconds, an idle relay costs a cheap index probe per
// poll interval, and a lost notification costs at most one poll interval.
package relay
