// Package testhooks lets tests, and the fault run's sabotaged builds, reach
// the moments where a fault matters inside the relay and the subscriber
// runtime, and break their guarantees on purpose to prove that a checker
// catches it. The hooks travel in the context given to Start, so they are
// not part of any public options: a program that embeds the relay or the
// runtime cannot set them, and production leaves them zero. Only tests and
// binaries built with the fanout_sabotage tag (cmd/fanout/sabotage_on.go)
// set them.
package testhooks

import (
	"context"
	"time"
)

// Relay breaks the relay.
type Relay struct {
	// SkipPublish, if set, names rows the relay marks sent without
	// publishing them.
	SkipPublish func(id int64) bool
	// FailPublish, if set, names rows whose publish fails as if NATS were
	// unreachable (the relay retries them).
	FailPublish func(id int64) bool
	// Unordered publishes without per-aggregate order: the claim takes an
	// aggregate's events while earlier ones are unpublished, and the wal
	// relay publishes them without waiting for the one before.
	Unordered bool
	// Anonymous (sabotage) publishes events as relays did before events
	// carried their database: Nats-Msg-Id is the bare row id, and no
	// restore that rewound the ids is looked for. Two databases' events,
	// or a restored database's, are then dropped as duplicates.
	Anonymous bool
	// NoAudit (sabotage) runs no auditor, whatever relay.audit says: an
	// event the stream lost after its PubAck stays lost.
	NoAudit bool
	// FailLookback, if set, is asked before each of the auditor's
	// lookbacks; true fails it as a stream still electing its leader
	// would.
	FailLookback func() bool
	// FailAtomic, if set, names atomic batches (by their rows' ids) that
	// fail as if the commit got no answer, before anything is sent: an
	// aggregate's chain, or a transaction's chunk.
	FailAtomic func(ids []int64) bool
	// AtomicReversed (sabotage) sends each atomic batch's events in the
	// reverse order: an aggregate's chain lands backwards.
	AtomicReversed bool
	// SplitTransactions (sabotage), with relay.atomic transaction,
	// publishes each transaction's events as two atomic batches, a moment
	// apart, instead of one.
	SplitTransactions bool
	// BacklogByEvent (sabotage), with relay.atomic transaction, has a wal
	// relay publish its slot's backlog event by event, as it did before
	// the backlog's snapshot was kept: its transactions enter the stream
	// without their batches.
	BacklogByEvent bool
	// MidBatch, if set, runs in each atomic batch after the first half of
	// its messages were sent and before the rest and the commit: a test
	// kills the relay there.
	MidBatch func()
}

// Subscriber breaks the subscriber runtime, or stops it at a moment.
type Subscriber struct {
	// BeforeAck, when set, runs after a batch's effects and checkpoints are
	// recorded and before its messages are acked: a test dies there, at
	// the worst moment.
	BeforeAck func(ctx context.Context, ids []int64)
	// AckBeforeCommit (sabotage) acks a TxHandler's batch before its
	// transaction commits, and waits this long in between: a crash in that
	// window loses the events.
	AckBeforeCommit time.Duration
	// Unordered (sabotage) runs an ordered subscriber without its order:
	// events are dispatched as they arrive and its per-aggregate
	// checkpoint is not consulted (its consumer still pins one instance).
	Unordered bool
}

type relayKey struct{}

type subscriberKey struct{}

// WithRelay returns ctx carrying h, for relay.Relay.Start.
func WithRelay(ctx context.Context, h Relay) context.Context {
	return context.WithValue(ctx, relayKey{}, h)
}

// RelayFrom returns the relay hooks ctx carries, or none.
func RelayFrom(ctx context.Context) Relay {
	h, _ := ctx.Value(relayKey{}).(Relay)
	return h
}

// WithSubscriber returns ctx carrying h, for subscribers.Runner.Start.
func WithSubscriber(ctx context.Context, h Subscriber) context.Context {
	return context.WithValue(ctx, subscriberKey{}, h)
}

// SubscriberFrom returns the subscriber hooks ctx carries, or none.
func SubscriberFrom(ctx context.Context) Subscriber {
	h, _ := ctx.Value(subscriberKey{}).(Subscriber)
	return h
}
