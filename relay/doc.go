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
// JetStream. Retention drops old rows by whole ranges (below).
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
//
// # Claiming under a held snapshot
//
// Every published row leaves an entry in the index the claim walks, and
// vacuum removes none while a transaction older than the row keeps its
// snapshot (a long report, a stuck session, a logical backup). A claim
// from the lowest id then steps over every event published since: in the
// held-horizon benchmark it slowed from 0.4 ms to 92 ms in two minutes.
// So the claim loop starts from a floor that trails the newest rows by a
// second (claimFloor), and a sweeper beside it claims the rows at or
// below the floor once a second (fullClaimEvery), walking from the lowest
// id: a row reaped, backed off, retried by an operator, or committed by a
// transaction open longer than a second. Its slow walk holds up no new row.
//
// # Claiming a burst
//
// A burst (a bulk import committing 300,000 rows at once) lands in a
// range whose statistics say it is empty, and the claim's plan, made with
// them, sorts every pending row of the range for each window. A new
// database's first events land in outbox_default (its first ids lie below
// the first range), analyzed while nearly empty, and the claim's plan
// scans it once per row. A claim that finds a backlog asks for the ranges
// above the floor and outbox_default to be analyzed (rangeStats.burst), at
// most once a minute.
//
// # Per-aggregate order
//
// Every row is numbered within its aggregate in commit order (aggregate_seq,
// schema migration 00009), and the relays publish each aggregate's events
// in that order, with any number of relays, publish failures, backoffs,
// leases expiring and relays killed mid-batch. The poll claim takes a row
// only when the event numbered before it in its aggregate is published
// (outbox's claimSQL and headOfAggregate: the numbers have no gaps, so
// that one stands for every earlier one), so an aggregate has at most one
// event in flight; when rows wait beyond a batch (a backlog), the relay
// claims the next events of each aggregate it published in the
// transaction that records the batch (deliver, outboxstore.Outcomes.Next),
// since the claim loop's floor may have passed them. Without a backlog,
// the next events are new rows the next claims find. A wal relay publishes
// rows from concurrent chunks that retry on their own, so each row waits
// for the previous row of its aggregate to be done (aggregateOrder).
// Different aggregates go in parallel as before.
//
// A backlog of busy aggregates is mostly events waiting for the one before
// them, and a claim that walks rows by id probes each of them. So a claim
// walks a window of unpublished rows above the floor (twice
// relay.max_in_flight), and when more lie beyond it, it goes round the
// aggregates instead (outbox.ClaimHeads: one probe per aggregate, finding
// each one's first unpublished event wherever it is), then raises the floor
// past the backlog; the sweeper walks the rows below the floor a window per
// sweep, round and round. Before this, draining bench:relay's 200 events
// per aggregate, each claim walked the whole backlog: 5 s of Postgres.
//
// A failed row holds its aggregate's later events (relay.on_failed hold):
// the poll claim leaves them pending, and a wal relay, which leaves
// published rows pending too, marks them failed behind it
// (outboxstore.HeldBehindReason). outbox retry-failed returns failed rows one
// per aggregate per statement, in order, so that a wal relay decodes them
// in order; outbox skip marks a row skipped and returns what was held
// behind it. relay.on_failed skip lets them pass.
//
// An aggregate's events waiting behind one another would go a round trip
// each: a transaction of 300,000 events of one aggregate drained at 2,500
// rows/s. Where the stream allows atomic batches (allow_atomic, NATS
// 2.12), a chain of them goes in one batch, which the stream stores whole
// and in the order sent, or not at all (atomic.go): the poll relay sends a
// batch's waves one after the other in one, and claims the next events of
// few busy aggregates a batch at a time (nextDepth); a wal relay sends the
// rows of a chunk waiting behind a ready one with it. A batch the stream
// refuses (it holds an event the stream already has, the commit got no
// answer) goes a wave at a time, as without them.
//
// Not ordered: rows written before migration 00009 (no number). The rows
// a poll relay left when an installation switches to wal capture are all
// published before the slot's stream starts (see below), so that none
// goes after a newer event of its aggregate.
//
// # A transaction's events together
//
// With relay.atomic transaction, a writer transaction is a unit. In wal
// capture the decoder cuts it into chunks of atomicMax rows (a full chunk
// goes once a row follows it, so the commit's chunk is never empty and
// says it is the last), and each chunk goes as one atomic batch once the
// events before its rows in their aggregates are done
// (publishTransaction). A batch the stream does not store is tried again
// until it is: going another way would let a subscriber see part of the
// transaction. One holding an event the stream has (the slot replayed a
// transaction whose batch was stored) goes again one by one, as the
// duplicates they are. In poll capture the relay claims transactions,
// not rows, by the writer's transaction each row records (txclaim.go):
// a chunk of atomicMax rows at a time, once the events before them in
// their aggregates are published, each chunk one atomic batch. The relay
// claims a big transaction's next chunks while one publishes, and
// publishes each once the ones before it are in the stream. A batch the
// stream does not store sends its rows, and the chunks claimed after it,
// back to wait and come back together.
//
// # Retention
//
// The outbox is partitioned by ranges of ids (schema migration 00008), and
// old events go by dropping whole ranges: no row is deleted one by one, so
// retention writes no WAL per row and leaves vacuum nothing to do. Every
// relay.cleanup_interval a relay asks the database (SECURITY DEFINER
// functions; the relay's role owns no table) to
//   - add ranges of relay.partition_size ids ahead of the identity
//     (fanout_outbox_extend), two beyond the current one;
//   - seal each range whose ids were all handed out, once no transaction
//     still inserts into it, noting the time and the WAL position
//     (fanout_outbox_seal);
//   - drop each sealed range whose rows were all published longer than
//     relay.sent_retention ago (fanout_outbox_retire). In poll capture: no
//     row in it pending or sending, none published within retention. In
//     wal capture: the slot confirmed past the position noted at the seal
//     (before that, the range's rows may still be undecoded, and the
//     decoder cannot read a dropped range: the benchmark's proof lost
//     events that way), no row waiting for the backlog's claim, none
//     returned by an operator within retention. Its failed rows move to
//     outbox_default, ids and all, for an operator.
//
// Rows that no range covers (written before the first range, or while the
// relays were stopped long enough for the ids to run past the ranges, or
// given an id by hand) land in outbox_default, so a writer never fails for
// want of a range; they are deleted one by one as before. Adding a range
// locks outbox_default and dropping one locks the outbox, each for a few
// milliseconds and waiting at most 200 ms (lock_timeout) for it; a pass
// that cannot get a lock tries again at the next.
//
// # Capture from the write-ahead log
//
// With relay.capture wal the relay does not claim rows: it streams the
// outbox's committed inserts (and updates, below) from a logical replication slot (relay.slot,
// plugin pgoutput, publication fanout_outbox, through jackc/pglogrepl), in
// commit order, and publishes each with the same subject, headers and
// Nats-Msg-Id as the poll relay, so nothing downstream can tell the two
// apart. The table is then an append-only log: the relay updates no row it
// publishes (a row it can never publish is still marked failed, with its
// reason), and retention drops whole ranges after relay.sent_retention.
//
// Rows an operator returns to the relays (outbox retry-failed, outbox
// republish, an UPDATE by hand) are updates, not inserts: the publication
// decodes updates too, and the relay publishes an updated row when it is
// pending and unpublished, as the poll relay would claim it. Every other
// version it decodes (inserted failed by hand, claimed, marked sent or
// failed) is not the relay's to publish. Rows returned to pending by a
// claimer (the reaper, a retry's backoff, the backlog drain's, or a poll
// relay's during a switch) are published at once too, and the claimer
// publishes them again: JetStream drops the second. An update that left a
// value stored out of line (TOAST) decodes without it, so such a row is
// read again from the table before its publish; a transaction's later
// version of a row replaces its earlier one.
//
// Slot safety: the position confirmed to the server only moves past a
// transaction once every one of its rows has a PubAck or is marked failed,
// in commit order (walStream.confirm), and past WAL without outbox rows
// only while nothing is in flight. A publish that fails for a reason
// outside the row (NATS down, the stream unavailable) is retried with
// backoff for as long as it takes: the slot waits, nothing is skipped, and
// no delivery is used up. A relay killed at any point restarts from the
// confirmed position; the events it had published since are published
// again and JetStream drops them as duplicates (the position is confirmed
// every second, far inside the duplicates window).
//
// Visibility: the walsender decodes a commit a moment before other sessions
// can see the transaction, and a subscriber that reads the rows an event
// names must find them (the fault run caught one that did not: an order
// "that does not exist"). A transaction is published only once a snapshot
// taken after its commit shows it (visibilityGate; one snapshot query
// answers for every transaction waiting at the time).
//
// Shutdown: a server shutting down waits, even in a fast shutdown, for its
// walsenders' clients to confirm what they were sent. A relay that cannot
// publish (NATS down) would hold Postgres up, so while its confirmation is
// stuck it asks a plain connection whether the server is stopping, and if
// so closes its stream; the events it had not confirmed are decoded again
// after the restart.
//
// One relay at a time: Postgres lets one connection stream from a slot.
// The others get "replication slot is active" and stand by, trying again
// every second; when the streaming relay dies its connection closes and a
// standby takes over within a second or two.
//
// Rows committed before the slot existed (a poll relay's backlog when an
// installation switches to wal) are not in its stream: the relay that
// creates the slot records in relay_capture the highest id then visible,
// claims and publishes the pending rows up to it as the poll relay would,
// before it starts the stream (the slot keeps the WAL meanwhile), marks
// the rows held behind a failed one failed behind it, and records when
// none is left. With relay.atomic transaction it claims the backlog by
// writer transactions: those visible in the snapshot the bound was read
// in (outboxstore.SlotBacklog); one in flight then is the slot's, whole.
//
// Switching back to poll: a poll relay that finds the slot takes over from
// the wal relays before its first claim (handover.go), so the rows they
// published, still pending, are not published again.
//
// The relay reads its slot every few seconds: fanout_relay_slot_lag_bytes
// and fanout_relay_slot_lag_seconds (how long it has been behind without
// moving); a warning when the server is near max_slot_wal_keep_size; not
// ready when it has been stuck past relay.stall_after. A slot the server
// invalidated is dropped and created again, and every pending row the
// outbox still holds is published again (recoverLostSlot); while the slot
// is stuck retention drops none of them.
//
// Events as pg_logical_emit_message records, with no table at all, were
// considered and not chosen: a writer in another language could no longer
// write an event with a plain INSERT, there would be no row to mark failed
// or to publish again after a broker lost data or a slot was invalidated,
// and the poll relay could not read them.
//
// # Where things are
//
// Each capability is a part with a type of its own, which the relay
// (relay.go: New, Start, Stop, Ready) creates, starts and stops; the parts
// share the relay's settings, connections and in-flight accounting
// (core.go):
//
//   - claim.go: the claim loop (runClaims, one for every claimer) and the
//     event claim of poll capture, its floor; sweep.go the sweeper below
//     the floor; stats.go the ranges' statistics a backlog asks for.
//   - publish.go and atomic.go, the publisher: messages, PubAcks and
//     atomic batches, for every capture (the messages themselves are
//     package wire's: the headers, the headers column, the limits);
//     origin.go, the origin guard: the database's identity on every
//     message, a foreign stream or a restore held off.
//   - deliver.go, the delivery: a claimed batch published an aggregate's
//     event at a time, recorded, and the next events claimed.
//   - txclaim.go and txchunks.go, the transaction delivery (relay.atomic
//     transaction): writer transactions claimed and published whole, a big
//     one's chunks pipelined.
//   - the wal capture: walstream.go the replication stream (standing by,
//     streaming, confirming), waldecode.go pgoutput messages into rows,
//     walpublish.go and waltransaction.go publishing what was decoded,
//     order.go per-aggregate order through its concurrent publishes,
//     walslot.go creating, recovering and watching the slot,
//     visibility.go the visibility gate, handover.go both switches between
//     capture modes (the backlog drain, the handover).
//   - audit.go and auditverify.go, the auditor; streamread.go its reads of
//     the stream.
//   - maintain.go, the maintainer: reaping and the outbox's ranges;
//     listen.go the writers' wake-ups.
//   - config.go, metrics.go and observer.go: the settings, the metrics and
//     what the relay reports.
//
// Every query on the outbox's tables is an outboxstore.Store method, beside its
// reasoning. What the relay asks Postgres itself is about the server and
// the replication slot: the replication protocol (create the slot, stream,
// confirm), pg_replication_slots, dropping a slot the server invalidated,
// pg_current_snapshot and pg_current_wal_lsn, the handover's advisory
// lock, LISTEN for the writers' wake-ups, and whether the server is
// stopping while a stream is stuck.
package relay
