package relay

import (
	"fmt"
	"time"

	"github.com/fanout/fanout/internal/validate"
	"github.com/fanout/fanout/outboxstore"
)

// Config is the relay's configuration (the relay.* keys). DefaultConfig
// holds the defaults; Validate names every key that is wrong.
type Config struct {
	// BatchSize is how many rows one claim takes. Default 1000, 1..10000.
	BatchSize int `koanf:"batch_size"`
	// MaxInFlight bounds rows claimed and not yet recorded (so also
	// unacknowledged async publishes). Default 4000, 1..100000, and at
	// least BatchSize.
	MaxInFlight int `koanf:"max_in_flight"`
	// PublishTimeout bounds the wait for one PubAck. Default 10s, > 0.
	PublishTimeout time.Duration `koanf:"publish_timeout"`
	// Lease is how long a claim lasts before the reaper may hand the row to
	// another relay. Default 2m, >= 1s, and more than PublishTimeout.
	Lease time.Duration `koanf:"lease"`
	// PollInterval is the longest the relay waits between claims when no
	// wake-up arrives: a lost wake-up costs at most this much latency.
	// Default 500ms, 1ms..1m.
	PollInterval time.Duration `koanf:"poll_interval"`
	// Listen subscribes to the writers' wake-up notifications. Default true.
	Listen bool `koanf:"listen"`
	// ReapInterval is how often expired leases are looked for. Default 10s, > 0.
	ReapInterval time.Duration `koanf:"reap_interval"`
	// RetryMin and RetryMax bound the exponential backoff of a failed
	// publish. Defaults 1s and 5m, 0 < min <= max. In wal capture, where
	// the slot waits for the rows, tries are at most 5s apart.
	RetryMin time.Duration `koanf:"retry_min"`
	RetryMax time.Duration `koanf:"retry_max"`
	// SentRetention is how long published rows are kept (for republish
	// after a broker loses data): a range of the outbox is dropped once its
	// last row was published that long ago; 0 drops it at the next cleanup.
	// Default 1h.
	SentRetention time.Duration `koanf:"sent_retention"`
	// PartitionSize is how many ids one range (partition) of the outbox
	// holds: retention drops whole ranges. Default 1000000, 1000..1000000000.
	PartitionSize int64 `koanf:"partition_size"`
	// CleanupInterval is how often ranges are added ahead of the ids and
	// dropped past retention. Default 1m, > 0.
	CleanupInterval time.Duration `koanf:"cleanup_interval"`
	// CleanupBatch is how many rows one delete removes from outbox_default
	// (rows no range holds). Default 1000, 1..100000.
	CleanupBatch int `koanf:"cleanup_batch"`
	// ShutdownTimeout bounds the graceful finish of the batch in flight at
	// SIGTERM. Default 30s, > 0.
	ShutdownTimeout time.Duration `koanf:"shutdown_timeout"`
	// Capture is how the relay finds committed rows: poll (claim them from
	// the table; the default) or wal (decode them from a logical
	// replication slot: see the package doc).
	Capture string `koanf:"capture"`
	// Slot is the wal relay's replication slot, created by the relay on
	// its first start in wal mode. Slot names are cluster-wide: two
	// installations on one server need two names. Default "fanout_relay";
	// lower-case letters, digits and underscores, at most 63.
	Slot string `koanf:"slot"`
	// OnFailed is what a failed row (one that can never be published) does
	// to the later events of its aggregate: hold them until an operator
	// returns it (outbox retry-failed) or skips it (outbox skip), or skip
	// it and publish them. Default hold: a subscriber that applies an
	// aggregate's events in order would otherwise apply them past a
	// missing one. fanout status and fanout_relay_outbox_held_rows show
	// what is held.
	OnFailed string `koanf:"on_failed"`
	// StallAfter: the relay reports not ready when it has completed no
	// claim for this long (it cannot reach Postgres or NATS, or its slots
	// are all waiting on PubAcks). Default 30s, longer than PublishTimeout
	// + PollInterval.
	StallAfter time.Duration `koanf:"stall_after"`
	// Audit runs the auditor (audit.go): it checks the stream against the
	// outbox and publishes again what the stream lost, and a range of the
	// outbox is dropped only after an audit of it passed. Default true.
	Audit bool `koanf:"audit"`
	// AuditInterval is how often the auditor looks for work. Default 10s,
	// 100ms..1h.
	AuditInterval time.Duration `koanf:"audit_interval"`
	// AuditDelay is how old a published event is when the continuous
	// audit checks it: longer than the server's sync_interval (2m unless
	// set), so that what it finds was on disk. Default 3m, 0..1h.
	AuditDelay time.Duration `koanf:"audit_delay"`
	// AuditLookback: when an auditor starts, and after a sign that the
	// stream may have lost messages (the relay's connection reconnected,
	// the stream's leader changed, its last sequence went back), the
	// events published this recently are checked again. Default 10m, at
	// least AuditDelay.
	AuditLookback time.Duration `koanf:"audit_lookback"`
	// Atomic is what enters the stream at once: event (each event as it is
	// published; the default) or transaction (a writer transaction's
	// events together or not at all, as one atomic batch (one of a single
	// event as one publish), a transaction of more than 1000 events in
	// chunks of 1000: see atomic.go, and
	// txclaim.go for poll capture). transaction needs max_in_flight of at
	// least 1000 and a stream that allows atomic batches (allow_atomic,
	// NATS 2.12).
	Atomic string `koanf:"atomic"`
	// UndeclaredEvents is what becomes of a row whose event type the
	// relay's declarations (Options.EventTypes) do not declare: publish
	// (the default: rows written by other languages or by hand need no
	// declaration) or fail (marked failed with the reason, as a payload
	// that breaks its declared schema always is).
	UndeclaredEvents string `koanf:"undeclared_events"`
}

// What the relay does with an undeclared event type (relay.undeclared_events).
const (
	UndeclaredPublish = "publish"
	UndeclaredFail    = "fail"
)

// Capture modes (relay.capture).
const (
	CapturePoll = "poll"
	CaptureWAL  = "wal"
)

// What enters the stream at once (relay.atomic).
const (
	AtomicEvent       = "event"
	AtomicTransaction = "transaction"
)

// Defaults the configuration files and the tests refer to.
const (
	DefaultSlot        = "fanout_relay"
	DefaultBatchSize   = 1000
	DefaultMaxInFlight = 4000
	DefaultLease       = 2 * time.Minute
	// DefaultPartitionSize: a million ids, about 17 minutes at 1000
	// writes/s and 3 hours at 100.
	DefaultPartitionSize = 1_000_000
)

// DefaultConfig returns the relay's defaults.
func DefaultConfig() Config {
	return Config{
		BatchSize: DefaultBatchSize, MaxInFlight: DefaultMaxInFlight, PublishTimeout: 10 * time.Second,
		Lease: DefaultLease, PollInterval: 500 * time.Millisecond, Listen: true, ReapInterval: 10 * time.Second,
		RetryMin: time.Second, RetryMax: 5 * time.Minute, SentRetention: time.Hour, PartitionSize: DefaultPartitionSize,
		CleanupInterval: time.Minute,
		CleanupBatch:    1000, ShutdownTimeout: 30 * time.Second, StallAfter: 30 * time.Second,
		Capture: CapturePoll, Slot: DefaultSlot, OnFailed: string(outboxstore.HoldFailed),
		Audit: true, AuditInterval: 10 * time.Second, AuditDelay: 3 * time.Minute, AuditLookback: 10 * time.Minute,
		Atomic: AtomicEvent, UndeclaredEvents: UndeclaredPublish,
	}
}

// Validate checks the relay.* keys, alone and together, naming every key
// that is wrong. The rule that ties them to stream.duplicate_window (see
// RepublishDelay) is checked where the sections are put together.
func (c Config) Validate() error {
	var v validate.Errors
	v.Between("relay.batch_size", int64(c.BatchSize), 1, 10000)
	v.Between("relay.max_in_flight", int64(c.MaxInFlight), 1, 100000)
	v.Positive("relay.publish_timeout", c.PublishTimeout)
	if c.Lease < time.Second {
		v.Bad("relay.lease", "must be at least 1s (got %s)", c.Lease)
	}
	if c.PollInterval < time.Millisecond || c.PollInterval > time.Minute {
		v.Bad("relay.poll_interval", "must be between 1ms and 1m (got %s)", c.PollInterval)
	}
	v.Positive("relay.reap_interval", c.ReapInterval)
	v.Positive("relay.retry_min", c.RetryMin)
	if c.RetryMax < c.RetryMin {
		v.Bad("relay.retry_max", "must be at least relay.retry_min (%s) (got %s)", c.RetryMin, c.RetryMax)
	}
	if c.SentRetention < 0 {
		v.Bad("relay.sent_retention", "must be 0 or a positive duration (got %s)", c.SentRetention)
	}
	v.Between("relay.partition_size", c.PartitionSize, 1000, 1_000_000_000)
	v.Positive("relay.cleanup_interval", c.CleanupInterval)
	v.Between("relay.cleanup_batch", int64(c.CleanupBatch), 1, 100000)
	v.Positive("relay.shutdown_timeout", c.ShutdownTimeout)
	v.Positive("relay.stall_after", c.StallAfter)
	v.OneOf("relay.capture", c.Capture, CapturePoll, CaptureWAL)
	v.OneOf("relay.on_failed", c.OnFailed, string(outboxstore.HoldFailed), string(outboxstore.SkipFailed))
	v.OneOf("relay.atomic", c.Atomic, AtomicEvent, AtomicTransaction)
	v.OneOf("relay.undeclared_events", c.UndeclaredEvents, UndeclaredPublish, UndeclaredFail)
	if c.Atomic == AtomicTransaction {
		if c.MaxInFlight < atomicMax {
			v.Bad("relay.max_in_flight", "must be at least %d with relay.atomic transaction, a chunk of a transaction being in flight at once (got %d)", atomicMax, c.MaxInFlight)
		}
	}
	if c.AuditInterval < 100*time.Millisecond || c.AuditInterval > time.Hour {
		v.Bad("relay.audit_interval", "must be between 100ms and 1h (got %s)", c.AuditInterval)
	}
	if c.AuditDelay < 0 || c.AuditDelay > time.Hour {
		v.Bad("relay.audit_delay", "must be between 0 and 1h (got %s)", c.AuditDelay)
	}
	if c.AuditLookback < c.AuditDelay {
		v.Bad("relay.audit_lookback", "must be at least relay.audit_delay (%s) (got %s)", c.AuditDelay, c.AuditLookback)
	}
	if !validSlotName(c.Slot) {
		v.Bad("relay.slot", "must be 1 to 63 lower-case letters, digits or underscores, as PostgreSQL requires of a replication slot's name (got %q)", c.Slot)
	}

	// The relay claims a whole batch only when that many rows fit in
	// flight: below it, it waits forever and publishes nothing.
	if c.MaxInFlight < c.BatchSize {
		v.Add(fmt.Errorf("relay.max_in_flight (%d) must be at least relay.batch_size (%d): the relay claims a batch only when all of it fits in flight, so it would never publish", c.MaxInFlight, c.BatchSize))
	}
	// A claim's lease must outlast the wait for its PubAcks, or every slow
	// publish is reaped and published again. (A lease under 1s is refused
	// above.)
	if c.Lease >= time.Second && c.Lease <= c.PublishTimeout {
		v.Add(fmt.Errorf("relay.lease (%s) must be longer than relay.publish_timeout (%s), or every slow publish would be reaped and published again", c.Lease, c.PublishTimeout))
	}
	// With every slot in flight, the next claim waits for PubAcks (up to
	// the publish timeout), and an idle relay claims once per poll
	// interval: neither is a stall.
	if c.StallAfter <= c.PublishTimeout+c.PollInterval {
		v.Add(fmt.Errorf("relay.stall_after (%s) must be longer than relay.publish_timeout (%s) + relay.poll_interval (%s), or a busy or idle relay would look stalled",
			c.StallAfter, c.PublishTimeout, c.PollInterval))
	}
	return v.Err()
}

// RepublishDelay is the longest a row's second publish can follow its first:
// a relay that published and died holds the row for its lease, the reaper
// notices within an interval, and a failed publish may back off retry_max.
// stream.duplicate_window must be longer, so JetStream drops the repeat.
func RepublishDelay(r Config) time.Duration {
	return r.Lease + r.PublishTimeout + r.ReapInterval + r.RetryMax
}

func validSlotName(s string) bool {
	if s == "" || len(s) > 63 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// claimWindow is how many unpublished rows above the floor a claim walks
// by id: the rows in flight (up to max_in_flight), and as many again.
func (c Config) claimWindow() int { return 2 * c.MaxInFlight }
