package subscribers

import (
	"fmt"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/validate"
	"github.com/fanout/fanout/stream"
)

// Config is the subscriber runtime's configuration (the subscribers.*
// keys; a subscriber may set OwnKeys for itself). DefaultConfig holds the
// defaults; Validate names every key that is wrong.
type Config struct {
	// Concurrency is how many batches one instance handles at once.
	// Default 4, 1..256.
	Concurrency int `koanf:"concurrency"`
	// BatchSize is how many events one handler transaction takes (for
	// subscribers whose effect is in Postgres). Default 100, 1..1000.
	BatchSize int `koanf:"batch_size"`
	// AckWait is how long JetStream waits for an ack before redelivering;
	// long work sends in-progress signals. Default 30s, >= 1s.
	AckWait time.Duration `koanf:"ack_wait"`
	// HandlerTimeout bounds one handler call (one batch, for subscribers
	// whose effect is in Postgres); past it the handler's context is
	// cancelled and the attempt counts as failed (unless a dependency is
	// down). Default 20s, >= 100ms, and shorter than AckWait.
	HandlerTimeout time.Duration `koanf:"handler_timeout"`
	// MaxFailures is how many times the handler may fail on an event (by
	// its own verdict, while every dependency answers) before the event
	// goes to the dead letters. Deliveries lost to an outage or a crash do
	// not count. Default 10, 1..1000.
	MaxFailures int `koanf:"max_failures"`
	// MaxCrashes is how many times the process may die while handling an
	// event (an attempt begun and never ended) before the event goes to the
	// dead letters unhandled. Default 3, 2..100 (with 1, the events that
	// died beside a crashing one would be dead-lettered with it: the second
	// crash is the one that isolates the culprit).
	MaxCrashes int `koanf:"max_crashes"`
	// MaxAckPending bounds unacknowledged events per consumer, across
	// instances. Default 1000, 1..100000.
	MaxAckPending int `koanf:"max_ack_pending"`
	// RetryMin and RetryMax bound the delay of a nak after a failed attempt,
	// which doubles with each failure. Defaults 1s and 1m.
	RetryMin time.Duration `koanf:"retry_min"`
	RetryMax time.Duration `koanf:"retry_max"`
	// Start is where a new subscriber's consumer begins: all (the stream's
	// whole history), new (only events after its creation), or time (from
	// StartTime). It matters only when the consumer is created. Default all.
	Start string `koanf:"start"`
	// StartTime is an RFC 3339 time, for Start = time.
	StartTime string `koanf:"start_time"`
	// DeadLetterStream holds events that failed for good. Default DEADLETTER.
	DeadLetterStream string `koanf:"dead_letter_stream"`
	// DeadLetterSubjectPrefix starts dead letters' subjects:
	// <prefix>.<subscriber>.<event_type>. Default "deadletter".
	DeadLetterSubjectPrefix string `koanf:"dead_letter_subject_prefix"`
	// DeadLetterProvision is auto (each subscriber creates or updates the
	// dead-letter stream at start), verify (it must exist: `fanout
	// provision` made it) or off. Default auto.
	DeadLetterProvision string `koanf:"dead_letter_provision"`
	// DeadLetterAPIPrefix is the JetStream API prefix under which the dead
	// letters' own account answers (the production layout's
	// $JS.DEADLETTER.API): its share of the store is watched, and a share
	// 80% full is logged and reported before it refuses letters. Empty
	// (the default): the dead letters have no share of their own, nothing
	// is watched.
	DeadLetterAPIPrefix string `koanf:"dead_letter_api_prefix"`
	// DeadLetterMaxAge is how long dead letters are kept. Default 720h (30
	// days), at least DeadLetterDuplicateWindow and more than twice AckWait.
	DeadLetterMaxAge time.Duration `koanf:"dead_letter_max_age"`
	// ShutdownTimeout bounds the drain at SIGTERM. Default 30s, > 0.
	ShutdownTimeout time.Duration `koanf:"shutdown_timeout"`
	// StallAfter: a subscriber with events waiting (in its consumer, or
	// delivered and unacknowledged) that has finished none for this long is
	// stalled: not ready, and it logs why (a handler that never returns,
	// a consumer that delivers nothing). While a dependency is down it
	// holds its events on purpose, and readiness names the dependency
	// instead. 0 disables the watchdog. Default 2m, 0 or >= 1s, and longer
	// than HandlerTimeout and RetryMax.
	StallAfter time.Duration `koanf:"stall_after"`
	// OnDeadLetter is what an ordered subscriber does with an aggregate
	// whose event went to the dead letters: hold (its later events go to
	// the dead letters behind it, naming it, until it is redriven) or skip
	// (its later events are applied without it). Default hold.
	OnDeadLetter string `koanf:"on_dead_letter"`
	// GapWait is how long an ordered subscriber waits for an earlier event
	// of an aggregate that has not arrived (still in flight, or redelivered
	// after a crash) before it applies the later one anyway, marked
	// AfterGap. Default 0: four times AckWait, at least 2m; else longer
	// than AckWait (a crashed instance's events come back after it).
	GapWait time.Duration `koanf:"gap_wait"`
	// PinnedTTL is how long an ordered subscriber's pinned instance may go
	// without pulling before JetStream pins another (a crashed instance's
	// successor takes over after it). Default 0: AckWait and 5s more;
	// else at least 3s and longer than AckWait. The events a crashed
	// instance held come back only after the ack wait: a successor pinned
	// before would see an aggregate's later event first, and one started
	// from new events would take it for the first of an aggregate from
	// before its start and apply it out of order.
	PinnedTTL time.Duration `koanf:"pinned_ttl"`
}

// OwnKeys are the subscribers.* keys each subscriber may set for itself,
// as subscribers.<name>.<key> (FANOUT_SUBSCRIBERS_<NAME>_<KEY>): how it
// takes and handles its events. A subscriber without its own value takes
// the shared one, and its settings are checked as a whole, as the shared
// ones are. The other subscribers.* keys (the dead-letter stream, the
// shutdown timeout) are one setting for all.
var OwnKeys = []string{"concurrency", "batch_size", "ack_wait", "handler_timeout", "max_failures", "max_crashes",
	"max_ack_pending", "retry_min", "retry_max", "start", "start_time", "stall_after",
	"on_dead_letter", "gap_wait", "pinned_ttl"}

// DeadLetterDuplicateWindow is how long the dead-letter stream remembers a
// dead letter's id (subscriber and event sequence): a subscriber that dies
// between storing a dead letter and terminating its event publishes it again
// on the redelivery, an ack wait or a restart later, and must not store it
// twice.
const DeadLetterDuplicateWindow = 10 * time.Minute

// gapWait is GapWait, with its default worked out.
// pinnedTTL is PinnedTTL, or its default: AckWait and 5s more.
func (c Config) pinnedTTL() time.Duration {
	if c.PinnedTTL != 0 {
		return c.PinnedTTL
	}
	return c.AckWait + pinnedAfterAckWait
}

// pinnedAfterAckWait is how long after the ack wait the pin moves by
// default: time for JetStream to queue a crashed instance's events for
// redelivery before the successor's first pull.
const pinnedAfterAckWait = 5 * time.Second

func (c Config) gapWait() time.Duration {
	if c.GapWait != 0 {
		return c.GapWait
	}
	return max(2*time.Minute, 4*c.AckWait)
}

// Backoff is the delay before the n-th retry of an event: retry_min
// doubled per failure (or delivery) after the first, capped at retry_max.
func (c Config) Backoff(n uint64) time.Duration {
	d := c.RetryMin
	for i := uint64(1); i < n && d < c.RetryMax; i++ {
		d *= 2
	}
	return min(d, c.RetryMax)
}

// DefaultConfig returns the runtime's defaults.
func DefaultConfig() Config {
	return Config{
		Concurrency: 4, BatchSize: 100, AckWait: 30 * time.Second, HandlerTimeout: 20 * time.Second,
		MaxFailures: 10, MaxCrashes: 3, MaxAckPending: 1000, RetryMin: time.Second, RetryMax: time.Minute,
		Start: "all", DeadLetterStream: "DEADLETTER", DeadLetterSubjectPrefix: "deadletter", DeadLetterProvision: "auto",
		DeadLetterMaxAge: 720 * time.Hour, ShutdownTimeout: 30 * time.Second, StallAfter: 2 * time.Minute,
		OnDeadLetter: "hold",
	}
}

// Validate checks the subscribers.* keys, alone and together, naming
// every key that is wrong. The rules that tie them to the stream.* keys
// are checked where the sections are put together.
func (c Config) Validate() error {
	var v validate.Errors
	v.Between("subscribers.concurrency", int64(c.Concurrency), 1, 256)
	v.Between("subscribers.batch_size", int64(c.BatchSize), 1, 1000)
	if c.AckWait < time.Second {
		v.Bad("subscribers.ack_wait", "must be at least 1s (got %s)", c.AckWait)
	}
	if c.HandlerTimeout < 100*time.Millisecond {
		v.Bad("subscribers.handler_timeout", "must be at least 100ms (got %s)", c.HandlerTimeout)
	}
	v.Between("subscribers.max_failures", int64(c.MaxFailures), 1, 1000)
	v.Between("subscribers.max_crashes", int64(c.MaxCrashes), 2, 100)
	v.Between("subscribers.max_ack_pending", int64(c.MaxAckPending), 1, 100000)
	v.Positive("subscribers.retry_min", c.RetryMin)
	if c.RetryMax < c.RetryMin {
		v.Bad("subscribers.retry_max", "must be at least subscribers.retry_min (%s) (got %s)", c.RetryMin, c.RetryMax)
	}
	v.OneOf("subscribers.start", c.Start, "all", "new", "time")
	if c.Start == "time" {
		if _, err := time.Parse(time.RFC3339, c.StartTime); err != nil {
			v.Bad("subscribers.start_time", "must be an RFC 3339 time such as 2026-01-02T15:04:05Z when subscribers.start is time (got %q)", c.StartTime)
		}
	}
	if !stream.ValidName(c.DeadLetterStream) {
		v.Bad("subscribers.dead_letter_stream", "must be a non-empty name without spaces, '.', '*', '>' or path separators (got %q)", c.DeadLetterStream)
	}
	if !stream.ValidSubjectToken(c.DeadLetterSubjectPrefix) {
		v.Bad("subscribers.dead_letter_subject_prefix", "must be one subject token without '.', '*', '>' or spaces (got %q)", c.DeadLetterSubjectPrefix)
	}
	v.Positive("subscribers.dead_letter_max_age", c.DeadLetterMaxAge)
	v.OneOf("subscribers.dead_letter_provision", c.DeadLetterProvision, "auto", "verify", "off")
	if p := c.DeadLetterAPIPrefix; p != "" && (strings.ContainsAny(p, "*> \t") || strings.HasPrefix(p, ".") || strings.HasSuffix(p, ".") || strings.Contains(p, "..")) {
		v.Bad("subscribers.dead_letter_api_prefix", "must be a subject without wildcards, such as $JS.DEADLETTER.API (got %q)", p)
	}
	v.Positive("subscribers.shutdown_timeout", c.ShutdownTimeout)
	if c.StallAfter != 0 && c.StallAfter < time.Second {
		v.Bad("subscribers.stall_after", "must be 0 (off) or at least 1s (got %s)", c.StallAfter)
	}
	v.OneOf("subscribers.on_dead_letter", c.OnDeadLetter, "hold", "skip")
	if c.GapWait != 0 && c.GapWait <= c.AckWait {
		v.Bad("subscribers.gap_wait", "must be 0 (four times subscribers.ack_wait, at least 2m) or longer than subscribers.ack_wait (%s), or an event redelivered after a crash would count as missing (got %s)", c.AckWait, c.GapWait)
	}
	if c.PinnedTTL != 0 && (c.PinnedTTL < 3*time.Second || c.PinnedTTL <= c.AckWait) {
		v.Bad("subscribers.pinned_ttl", "must be 0 (subscribers.ack_wait and 5s more) or at least 3s and longer than subscribers.ack_wait (%s), or a successor pinned before a crashed instance's events come back could apply an aggregate's later event first (got %s)", c.AckWait, c.PinnedTTL)
	}

	// A handler cut off by its timeout has stopped before JetStream would
	// redeliver its event, even if the in-progress signals that extend the
	// ack wait were lost (a reconnect): otherwise another instance could
	// handle the event while the first still runs.
	if c.HandlerTimeout >= c.AckWait {
		v.Add(fmt.Errorf("subscribers.handler_timeout (%s) must be shorter than subscribers.ack_wait (%s): a handler must be cut off before JetStream may redeliver its event to another instance", c.HandlerTimeout, c.AckWait))
	}
	// A batch may run for the handler timeout, and a failing event waits up
	// to retry_max for its next attempt: neither settles an event for that
	// long, and neither is a stall.
	if c.StallAfter != 0 && c.StallAfter <= max(c.HandlerTimeout, c.RetryMax) {
		v.Add(fmt.Errorf("subscribers.stall_after (%s) must be 0 (off) or longer than subscribers.handler_timeout (%s) and subscribers.retry_max (%s), or a slow batch or a retrying event would look stalled",
			c.StallAfter, c.HandlerTimeout, c.RetryMax))
	}
	// A subscriber that dies between storing a dead letter and terminating
	// its event publishes the dead letter again on the redelivery; the
	// dead-letter stream must still remember its id then, and JetStream
	// refuses a duplicates window longer than the max age.
	if c.DeadLetterMaxAge < DeadLetterDuplicateWindow || c.DeadLetterMaxAge <= 2*c.AckWait {
		v.Add(fmt.Errorf("subscribers.dead_letter_max_age (%s) must be at least %s, the dead letters' duplicates window, and more than twice subscribers.ack_wait (%s): a dead letter published again after a crash must still be recognized",
			c.DeadLetterMaxAge, DeadLetterDuplicateWindow, c.AckWait))
	}
	return v.Err()
}
