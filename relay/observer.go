package relay

import "time"

// Observer is told what the relay does; metrics implement it. Its methods
// are called from several goroutines and must not block.
type Observer interface {
	// Claimed reports a claimed batch of n rows and how long the claim took.
	Claimed(n int, took time.Duration)
	// Published reports rows whose PubAck arrived and were marked sent.
	Published(events []Published)
	// Retried reports rows returned to pending after a failed publish.
	Retried(n int)
	// Failed reports rows marked failed, which will never be published.
	Failed(n int)
	// Reaped reports rows whose lease expired, returned to pending.
	Reaped(n int)
	// Deleted reports sent rows of outbox_default deleted after their
	// retention (rows no range of the outbox holds).
	Deleted(n int)
	// OutboxRanges reports, after each retention pass, how many ranges
	// (partitions) the outbox holds and how many the pass dropped.
	OutboxRanges(held, dropped int)
	// SlotLag reports, in wal capture, how far the replication slot's
	// confirmed position is behind the server's WAL, and for how long it
	// has been behind without moving (0 when it is not behind).
	SlotLag(bytes int64, stuck time.Duration)
	// ConfigDifferences reports, after each check of the stream, how many
	// of object's settings differ from fanout's configuration.
	ConfigDifferences(object string, n int)
	// Rewound reports a restore that rewound the outbox's ids (origin.go).
	Rewound()
	// Audited reports an audit of the stream against the outbox
	// (audit.go): events checked, found missing, and published again.
	Audited(kind string, checked, missing, repaired int)
	// AuditAltered reports events an audit found in the stream with other
	// content than their rows' (auditverify.go), which no repair replaces.
	AuditAltered(kind string, n int)
	// AtomicBatch reports an atomic batch of events (atomic.go): stored
	// whole, or refused or unanswered (err) and its events published again
	// another way or later.
	AtomicBatch(events int, err error)
}

// Published describes one row stored in the stream.
type Published struct {
	ID        int64
	CreatedAt time.Time // when the writer's transaction inserted the row
	AckedAt   time.Time // when its PubAck arrived
	Duplicate bool      // JetStream already had it (an earlier publish of this row)
}

// NopObserver ignores everything.
type NopObserver struct{}

func (NopObserver) Claimed(int, time.Duration)    {}
func (NopObserver) Published([]Published)         {}
func (NopObserver) Retried(int)                   {}
func (NopObserver) Failed(int)                    {}
func (NopObserver) Reaped(int)                    {}
func (NopObserver) Deleted(int)                   {}
func (NopObserver) OutboxRanges(int, int)         {}
func (NopObserver) SlotLag(int64, time.Duration)  {}
func (NopObserver) ConfigDifferences(string, int) {}
func (NopObserver) Rewound()                      {}
func (NopObserver) Audited(string, int, int, int) {}
func (NopObserver) AuditAltered(string, int)      {}
func (NopObserver) AtomicBatch(int, error)        {}
