// Package relay moves committed outbox rows onto the JetStream stream.
//
// A relay claims a batch of pending rows (FOR UPDATE SKIP LOCKED, so any
// number of relays share the table), moves them to `sending` under a lease
// (claim time plus a random token), publishes each row asynchronously with
// Nats-Msg-Id set to the row id, and marks each row `sent` only after its own
// PubAck, and only while its lease token still matches. A row whose publish
// failed goes back to `pending` with exponential backoff; a row that can
// never be published (a subject token NATS rejects, a payload over the
// server's max_payload) becomes `failed` with the reason and blocks nothing.
// A reaper returns rows whose lease expired (their relay died or stalled) to
// `pending`; since the stream's duplicates window is longer than the lease
// plus the publish timeout, a second publish of such a row is dropped by
// JetStream. A cleaner deletes sent rows after a retention period.
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
