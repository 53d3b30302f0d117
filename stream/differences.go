package stream

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// Difference is one setting of a live stream or consumer that is not what
// fanout's configuration makes it.
type Difference struct {
	// Field is the setting's JSON name, as `nats stream info --json`
	// shows it.
	Field      string
	Have, Want string
	// Lowers is set when applying Want would lower a limit: the stream
	// would then drop stored messages sooner, as a purge would.
	Lowers bool
}

func (d Difference) String() string {
	s := fmt.Sprintf("%s is %s, fanout's configuration says %s", d.Field, d.Have, d.Want)
	if d.Lowers {
		s += " (a lower limit)"
	}
	return s
}

// Join lists ds on one line.
func Join(ds []Difference) string {
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = d.String()
	}
	return strings.Join(parts, "; ")
}

// streamField is one setting that changes what a stream keeps or lets in.
// Description and metadata are left out: they change nothing.
type streamField struct {
	name  string
	value func(jetstream.StreamConfig) string
	// limit reads a limit where 0 or less means none; nil for a setting
	// that is not a limit.
	limit func(jetstream.StreamConfig) int64
}

var streamFields = []streamField{
	{name: "subjects", value: func(c jetstream.StreamConfig) string { return sortedList(c.Subjects) }},
	{name: "retention", value: func(c jetstream.StreamConfig) string { return c.Retention.String() }},
	{name: "discard", value: func(c jetstream.StreamConfig) string { return c.Discard.String() }},
	{name: "discard_new_per_subject", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.DiscardNewPerSubject) }},
	{name: "storage", value: func(c jetstream.StreamConfig) string { return c.Storage.String() }},
	{name: "max_age", value: func(c jetstream.StreamConfig) string { return unlimitedOr(int64(c.MaxAge), c.MaxAge.String()) },
		limit: func(c jetstream.StreamConfig) int64 { return int64(c.MaxAge) }},
	{name: "max_bytes", value: func(c jetstream.StreamConfig) string {
		return unlimitedOr(c.MaxBytes, strconv.FormatInt(c.MaxBytes, 10))
	},
		limit: func(c jetstream.StreamConfig) int64 { return c.MaxBytes }},
	{name: "max_msgs", value: func(c jetstream.StreamConfig) string { return unlimitedOr(c.MaxMsgs, strconv.FormatInt(c.MaxMsgs, 10)) },
		limit: func(c jetstream.StreamConfig) int64 { return c.MaxMsgs }},
	{name: "max_msgs_per_subject", value: func(c jetstream.StreamConfig) string {
		return unlimitedOr(c.MaxMsgsPerSubject, strconv.FormatInt(c.MaxMsgsPerSubject, 10))
	}, limit: func(c jetstream.StreamConfig) int64 { return c.MaxMsgsPerSubject }},
	{name: "max_msg_size", value: func(c jetstream.StreamConfig) string {
		return unlimitedOr(int64(c.MaxMsgSize), strconv.FormatInt(int64(c.MaxMsgSize), 10))
	}, limit: func(c jetstream.StreamConfig) int64 { return int64(c.MaxMsgSize) }},
	{name: "max_consumers", value: func(c jetstream.StreamConfig) string {
		return unlimitedOr(int64(c.MaxConsumers), strconv.Itoa(c.MaxConsumers))
	}, limit: func(c jetstream.StreamConfig) int64 { return int64(c.MaxConsumers) }},
	// A shorter window lets a row published twice be stored twice.
	{name: "duplicate_window", value: func(c jetstream.StreamConfig) string { return c.Duplicates.String() },
		limit: func(c jetstream.StreamConfig) int64 { return int64(c.Duplicates) }},
	// Fewer replicas keep fewer copies.
	{name: "num_replicas", value: func(c jetstream.StreamConfig) string { return strconv.Itoa(max(c.Replicas, 1)) },
		limit: func(c jetstream.StreamConfig) int64 { return int64(max(c.Replicas, 1)) }},
	{name: "deny_delete", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.DenyDelete) }},
	{name: "deny_purge", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.DenyPurge) }},
	// A rollup header purges a subject, or the stream, by a publish.
	{name: "allow_rollup_hdrs", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.AllowRollup) }},
	// A per-message TTL lets a publish set its own, shorter, age.
	{name: "allow_msg_ttl", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.AllowMsgTTL) }},
	{name: "sealed", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.Sealed) }},
	{name: "no_ack", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.NoAck) }},
	{name: "mirror", value: func(c jetstream.StreamConfig) string { return jsonOrNone(c.Mirror) }},
	{name: "sources", value: func(c jetstream.StreamConfig) string { return jsonOrNone(c.Sources) }},
	{name: "subject_transform", value: func(c jetstream.StreamConfig) string { return jsonOrNone(c.SubjectTransform) }},
	{name: "republish", value: func(c jetstream.StreamConfig) string { return jsonOrNone(c.RePublish) }},
	{name: "consumer_limits", value: func(c jetstream.StreamConfig) string {
		if c.ConsumerLimits == (jetstream.StreamConsumerLimits{}) {
			return "none"
		}
		return jsonOrNone(c.ConsumerLimits)
	}},
}

// AdvisoryDifferences are the settings a provision applies but the roles'
// drift checks leave alone: they change how a stream is read, not what it
// keeps or delivers, and a stream without them works, more slowly.
func AdvisoryDifferences(have, want jetstream.StreamConfig) []Difference {
	var ds []Difference
	if have.AllowDirect != want.AllowDirect {
		ds = append(ds, Difference{Field: "allow_direct", Have: strconv.FormatBool(have.AllowDirect), Want: strconv.FormatBool(want.AllowDirect)})
	}
	if have.AllowAtomicPublish != want.AllowAtomicPublish {
		ds = append(ds, Difference{Field: "allow_atomic", Have: strconv.FormatBool(have.AllowAtomicPublish), Want: strconv.FormatBool(want.AllowAtomicPublish)})
	}
	return ds
}

// StreamDifferences lists the settings in which have, a live stream's
// configuration, is not want, fanout's.
func StreamDifferences(have, want jetstream.StreamConfig) []Difference {
	var ds []Difference
	for _, f := range streamFields {
		h, w := f.value(have), f.value(want)
		if h == w {
			continue
		}
		d := Difference{Field: f.name, Have: h, Want: w}
		if f.limit != nil {
			d.Lowers = lowers(f.limit(have), f.limit(want))
		}
		ds = append(ds, d)
	}
	return ds
}

// lowers reports whether a limit going from have to want is a lower one
// (0 or less is no limit).
func lowers(have, want int64) bool {
	if want <= 0 {
		return false
	}
	return have <= 0 || want < have
}

func unlimitedOr(v int64, s string) string {
	if v <= 0 {
		return "unlimited"
	}
	return s
}

func sortedList(ss []string) string {
	ss = slices.Clone(ss)
	slices.Sort(ss)
	return "[" + strings.Join(ss, " ") + "]"
}

func jsonOrNone(v any) string {
	b, err := json.Marshal(v)
	if err != nil || string(b) == "null" || string(b) == "[]" {
		return "none"
	}
	return string(b)
}
