// Package subscribers is the consumer runtime every subscriber runs on, and
// the parent of one package per subscriber (invoicing, cacheinval, ...).
//
// A subscriber is declared once (Declaration): its name (its durable
// consumer's name, stable forever), the event types it wants, whether it
// is ordered, and how its handler is made. The handler has a method that
// handles one event: HandleTx (a TxHandler, whose effects commit with its
// checkpoint) or Handle (an EventHandler, whose effects live outside
// Postgres). Which one runs is chosen where the handler is made, by the
// compiler: subscribers.Tx(h) or subscribers.Each(h) make the Handler the
// runtime takes. A DependentHandler also names what it needs besides
// Postgres, with a probe each. The runtime gives each subscriber one durable pull consumer on
// the events stream, shared by all its instances, and turns the handler's
// result into the message's fate:
//
//	handler returns        runtime does
//	nil                    checkpoint the event, then ack
//	RetryAfter(d)          nak with delay d (a snooze: not a failure)
//	Permanent(err)         publish to the dead letters with the reason, then term
//	Unavailable(dep, err)  hold the event until dep answers again (not a failure)
//	other error            a failure if every dependency answers its probe
//	                       (nak with a delay doubling per failure), else an outage
//
// (JetStream's consumer BackOff applies only to ack timeouts, not to naks, so
// the runtime computes the delay itself.)
//
// # Outages are not failures
//
// While a dependency is down (the checkpoint store, a declared dependency,
// the dead-letter stream) the runner pulls nothing, keeps the events it holds
// alive with in-progress signals, and probes the dependency with backoff; its
// Ready method (the /readyz of its process) names it. Deliveries lost to an
// outage cost an event nothing: the consumer redelivers without limit, and
// the runtime keeps its own count in subscriber_attempts (see attempts.go):
// an event is dead-lettered after max_failures failures of its handler, or
// after max_crashes attempts that never ended because the process died. An
// event in the checkpoint is acked, never dead-lettered; an event is termed
// only after its dead letter has a PubAck.
//
// # Exactly once in effect
//
// Every subscriber records (subscriber, event_id) in the processed_events
// checkpoint; an event already there is acked and skipped. A TxHandler, whose
// effect is in Postgres, runs inside a transaction the runtime opens: the
// checkpoint rows and the effects of a batch of events commit together, and
// the messages are acked (double ack: the server confirms) only after the
// commit. A crash between commit and ack redelivers events whose checkpoint
// is already there, so they are skipped. If one event of a batch fails, the
// batch is rolled back and its events are handled again one per transaction,
// so one bad event never holds up the others.
//
// # Ordered subscribers
//
// A subscriber whose handler applies each event's payload in turn (an
// order's state machine, a balance, a projection) declares itself Ordered,
// its handler made with Tx. Each aggregate's events then reach its
// handler one at a time, in their aggregate's order (outbox.aggregate_seq,
// the Fanout-Aggregate-Seq header, which the relay publishes in order),
// while different aggregates run side by side, up to
// subscribers.concurrency batches of one event per aggregate each.
//
// How, and why this way:
//
//   - One instance at a time. The consumer has a priority group with the
//     pinned-client policy: JetStream delivers to one instance, the others
//     wait as standbys, and one takes over when the pinned instance stops
//     pulling for subscribers.pinned_ttl (a crash, a stop). Partitioning
//     (a consumer per partition of the subject space, by subject
//     transform) would let several instances share the work, but fanout's
//     subjects name the event type, not the aggregate: partitioning needs
//     the aggregate in the subject, a change to every subject, filter and
//     permission. And a partition's failing event would hold the whole
//     partition, where here it holds only its own aggregate. So an ordered
//     subscriber's throughput is one instance's; more instances add
//     failover, not speed.
//   - In the instance, the dispatcher (ordered.go) keeps each aggregate's
//     received events sorted by number and hands a worker an aggregate's
//     next event only when the one before it is done. A failing event is
//     retried with its usual backoff; its aggregate's later events wait in
//     hand (kept alive), the other aggregates go on.
//   - JetStream does not promise exclusivity while the pin moves (an
//     instance may still be working when another is pinned). The
//     guarantee is in Postgres: subscriber_aggregates
//     (orderedcheckpoint.go) holds, per aggregate, the number of the last
//     event applied, and the handler's transaction moves it from n-1 to n
//     under its row lock, before the handler runs. Its first row is made
//     only by the aggregate's first event, or by an event applied after a
//     gap. Two instances never apply one aggregate's events at once, and
//     never out of order; an event that is not its aggregate's next is
//     sent back and tried again.
//   - A duplicate (already in processed_events) is acked and skipped, as
//     everywhere. A gap (an earlier event has not arrived: in flight, or
//     redelivered after a crash) is waited for, for subscribers.gap_wait
//     (orderedturn.go); then the event is applied with Event.AfterGap
//     set, and the handler decides what that means (fulfilment records a
//     violation). An event that arrives after its aggregate moved past it
//     is sent to the dead letters as late, never applied out of order.
//   - A dead-lettered event holds its aggregate (subscribers.on_dead_letter
//     = hold, the default): the aggregate's later events go to the dead
//     letters behind it, each naming it (Fanout-Dead-Held-By;
//     `fanout dlq list` shows which events each letter holds). To go on,
//     redrive it (`fanout dlq redrive`, once fixed) or discard it (`fanout
//     dlq discard`, which moves the aggregate past it), then redrive the
//     held letters, in order. With skip, the aggregate moves past the
//     dead-lettered event at once.
//
// An ordered subscriber's effects must be in Postgres (its handler a Tx):
// the per-aggregate checkpoint commits with them. Events without a number
// (written before migration 00009) are taken in the order they arrive.
//
// # Adding a subscriber
//
// See the README's "Adding a subscriber": the steps are kept there, once.
package subscribers
