package stream

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// consumerField is one setting that changes what a consumer delivers, to
// whom, how often, or how long it lives.
type consumerField struct {
	name  string
	value func(jetstream.ConsumerConfig) string
}

// startPosition is compared for readers only. A reader
// (ReaderConsumerConfig) delivers all: a reset below a start sequence or
// time is refused. A subscriber's start position mattered when its
// consumer was made, JetStream refuses to change it, and `fanout replay`
// moves the position on purpose.
var startPosition = consumerField{"deliver_policy", func(c jetstream.ConsumerConfig) string { return c.DeliverPolicy.String() }}

// JetStream's own defaults, so that a setting left out and the same
// setting spelled out compare equal.
const (
	defaultAckWait    = 30 * time.Second
	defaultMaxWaiting = 512
)

var consumerFields = []consumerField{
	{"ack_policy", func(c jetstream.ConsumerConfig) string { return c.AckPolicy.String() }},
	{"ack_wait", func(c jetstream.ConsumerConfig) string { return durationOr(c.AckWait, defaultAckWait.String()) }},
	{"max_deliver", func(c jetstream.ConsumerConfig) string {
		if c.MaxDeliver <= 0 {
			return "unlimited"
		}
		return strconv.Itoa(c.MaxDeliver)
	}},
	{"backoff", func(c jetstream.ConsumerConfig) string { return list(c.BackOff) }},
	{"filter_subjects", func(c jetstream.ConsumerConfig) string {
		fs := slices.Clone(c.FilterSubjects)
		if c.FilterSubject != "" {
			fs = append(fs, c.FilterSubject)
		}
		return sortedList(fs)
	}},
	{"max_ack_pending", func(c jetstream.ConsumerConfig) string { return strconv.Itoa(c.MaxAckPending) }},
	{"max_waiting", func(c jetstream.ConsumerConfig) string {
		if c.MaxWaiting == 0 {
			return strconv.Itoa(defaultMaxWaiting)
		}
		return strconv.Itoa(c.MaxWaiting)
	}},
	{"max_batch", func(c jetstream.ConsumerConfig) string { return intOr(c.MaxRequestBatch, "unlimited") }},
	{"max_expires", func(c jetstream.ConsumerConfig) string { return durationOr(c.MaxRequestExpires, "unlimited") }},
	{"max_bytes", func(c jetstream.ConsumerConfig) string { return intOr(c.MaxRequestMaxBytes, "unlimited") }},
	{"headers_only", func(c jetstream.ConsumerConfig) string { return strconv.FormatBool(c.HeadersOnly) }},
	// A durable with an inactive threshold is deleted once idle.
	{"inactive_threshold", func(c jetstream.ConsumerConfig) string { return durationOr(c.InactiveThreshold, "none") }},
	{"pause_until", func(c jetstream.ConsumerConfig) string {
		if c.PauseUntil == nil || c.PauseUntil.IsZero() {
			return "none"
		}
		return c.PauseUntil.UTC().Format(time.RFC3339)
	}},
	{"num_replicas", func(c jetstream.ConsumerConfig) string { return intOr(c.Replicas, "the stream's") }},
	{"mem_storage", func(c jetstream.ConsumerConfig) string { return strconv.FormatBool(c.MemoryStorage) }},
	{"priority_policy", func(c jetstream.ConsumerConfig) string {
		b, err := c.PriorityPolicy.MarshalJSON()
		if err != nil {
			return strconv.Itoa(int(c.PriorityPolicy))
		}
		return strings.Trim(string(b), `"`)
	}},
	{"priority_groups", func(c jetstream.ConsumerConfig) string { return "[" + strings.Join(c.PriorityGroups, " ") + "]" }},
	{"priority_timeout", func(c jetstream.ConsumerConfig) string { return durationOr(c.PinnedTTL, "none") }},
	// A consumer with a deliver subject pushes its messages there: to
	// anyone listening in the stream's account, and no longer to pulls.
	{"deliver_subject", func(c jetstream.ConsumerConfig) string { return orNone(c.DeliverSubject, "none (pull)") }},
	{"deliver_group", func(c jetstream.ConsumerConfig) string { return orNone(c.DeliverGroup, "none") }},
	{"flow_control", func(c jetstream.ConsumerConfig) string { return strconv.FormatBool(c.FlowControl) }},
	{"idle_heartbeat", func(c jetstream.ConsumerConfig) string { return durationOr(c.IdleHeartbeat, "none") }},
	{"rate_limit_bps", func(c jetstream.ConsumerConfig) string { return intOr(int(c.RateLimit), "unlimited") }},
	// "original" delivers at the pace the events were published: a
	// subscriber catching up would take as long as the backlog took.
	{"replay_policy", func(c jetstream.ConsumerConfig) string { return c.ReplayPolicy.String() }},
	{"sample_freq", func(c jetstream.ConsumerConfig) string { return orNone(c.SampleFrequency, "none") }},
	{"metadata", func(c jetstream.ConsumerConfig) string { return ownMetadata(c.Metadata) }},
}

// ownMetadata is a consumer's metadata without what the server adds
// itself (keys "_nats.*": its version, the API level), sorted.
func ownMetadata(m map[string]string) string {
	var kv []string
	for k, v := range m {
		if !strings.HasPrefix(k, "_nats.") {
			kv = append(kv, k+"="+v)
		}
	}
	slices.Sort(kv)
	return "[" + strings.Join(kv, " ") + "]"
}

// ConsumerDifferences lists the settings in which have, a live
// subscriber's consumer's configuration, is not want, the one fanout gives
// it: every setting but the start position.
func ConsumerDifferences(have, want jetstream.ConsumerConfig) []Difference {
	return consumerDifferences(have, want, false)
}

// ReaderDifferences lists the settings in which have, a live reader
// consumer's configuration, is not want, its ReaderConsumerConfig: every
// setting, the start position too.
func ReaderDifferences(have, want jetstream.ConsumerConfig) []Difference {
	return consumerDifferences(have, want, true)
}

func consumerDifferences(have, want jetstream.ConsumerConfig, position bool) []Difference {
	fields := consumerFields
	if position {
		fields = append([]consumerField{startPosition}, fields...)
	}
	var ds []Difference
	for _, f := range fields {
		if h, w := f.value(have), f.value(want); h != w {
			ds = append(ds, Difference{Field: f.name, Have: h, Want: w})
		}
	}
	return ds
}

func orNone(s, none string) string {
	if s == "" {
		return none
	}
	return s
}

func durationOr(d time.Duration, none string) string {
	if d <= 0 {
		return none
	}
	return d.String()
}

func intOr(n int, none string) string {
	if n <= 0 {
		return none
	}
	return strconv.Itoa(n)
}

func list(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none"
	}
	return fmt.Sprint(ds)
}
