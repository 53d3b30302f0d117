package subscribers

import (
	"time"
)

// Observer is told what a runner does; metrics implement it. Its methods
// are called from several goroutines and must not block.
type Observer interface {
	// Handled reports events whose effect committed, and how long their
	// batch took.
	Handled(subscriber string, n int, took time.Duration)
	// Skipped reports events already in the checkpoint (redeliveries,
	// duplicate publishes).
	Skipped(subscriber string, n int)
	// Retried reports events naked for a later redelivery.
	Retried(subscriber string, n int)
	// DeadLettered reports events sent to the dead letters.
	DeadLettered(subscriber string, n int)
	// DependencyDown reports that a dependency stopped answering: the
	// subscriber holds its events and takes no new ones.
	DependencyDown(subscriber, dependency string)
	// DependencyUp reports that a dependency answers (again, after down;
	// 0 when it is first known).
	DependencyUp(subscriber, dependency string, down time.Duration)
	// Stalled reports that the subscriber became stalled (true: events
	// wait and it settles none for subscribers.stall_after) or recovered.
	Stalled(subscriber string, stalled bool)
	// Timed reports, for events just handled, when each passed each stage
	// of its way.
	Timed(subscriber string, events []EventTimes)
	// ConfigDifferences reports, after each check, how many of object's
	// settings (a stream or the subscriber's consumer) differ from
	// fanout's configuration.
	ConfigDifferences(subscriber, object string, n int)
	// DeadLetterShare reports how much of the dead letters' share of the
	// store is used, and its limit (-1: none), after each check.
	DeadLetterShare(subscriber string, used, limit int64)
}

// EventTimes are when one event passed each stage of its way to a
// subscriber. Committed is the outbox row's created_at (its writer's
// transaction, on Postgres's clock); Stored is when the stream stored it,
// which is when the relay's PubAck was sent (on the NATS server's clock);
// Delivered is when the runtime took it from its consumer, and Handled when
// its effect and checkpoint had committed (on this process's clock). On one
// machine, or with synchronised clocks, the differences are the stages:
// commit → PubAck, PubAck → delivered, delivered → handled.
type EventTimes struct {
	Committed, Stored, Delivered, Handled time.Time
}

// NopObserver ignores everything.
type NopObserver struct{}

func (NopObserver) Handled(string, int, time.Duration)         {}
func (NopObserver) Skipped(string, int)                        {}
func (NopObserver) Retried(string, int)                        {}
func (NopObserver) DeadLettered(string, int)                   {}
func (NopObserver) DependencyDown(string, string)              {}
func (NopObserver) DependencyUp(string, string, time.Duration) {}
func (NopObserver) Timed(string, []EventTimes)                 {}
func (NopObserver) Stalled(string, bool)                       {}
func (NopObserver) ConfigDifferences(string, string, int)      {}
func (NopObserver) DeadLetterShare(string, int64, int64)       {}
