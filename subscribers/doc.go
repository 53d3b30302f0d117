// Package subscribers is the consumer runtime every subscriber runs on, and
// the parent of one package per subscriber (invoicing, cacheinval, ...).
//
// A subscriber is a Handler: a name (its durable consumer's name, stable
// forever), the event types it wants, and a method that handles one event.
// The runtime gives each subscriber one durable pull consumer on the events
// stream, shared by all its instances, and turns the handler's result into
// the message's fate:
//
//	handler returns     runtime does
//	nil                 checkpoint the event, then ack
//	RetryAfter(d)       nak with delay d
//	Permanent(err)      publish to the dead letters with the reason, then term
//	other error         nak with a delay that doubles with each delivery
//
// (JetStream's consumer BackOff applies only to ack timeouts, not to naks, so
// the runtime computes the delay itself.) An event that still fails on its
// last delivery goes to the dead letters too: nothing is dropped silently.
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
// # Adding a subscriber
//
// Write a package under subscribers/ with a type that implements Handler and
// either EventHandler or TxHandler, add one line to the registry in
// cmd/fanout/registry.go, and one service to deploy/compose.yaml. Writers,
// the relay and the schema do not change: the new subscriber's consumer is
// created on its first start and, with subscribers.start = all, replays the
// stream's history (stream.max_age, 7 days by default). Run the conformance
// suite (package subscribertest) in the new package's tests.
package subscribers
