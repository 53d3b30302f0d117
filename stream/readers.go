package stream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Reader consumers are the durable pull consumers that read the stream
// back for a role other than a subscriber: the relay's audit
// (AuditConsumer, AuditCommandConsumer) and the operator's reindex
// (ReindexConsumer). They are made once, by `fanout provision`, with one
// fixed configuration (ReaderConsumerConfig), and their user only moves
// them (a reset to a stream sequence) and pulls. A user allowed to create
// its reader with a configuration of its choosing could make it a push
// consumer delivering into the JetStream API ($JS.API.CONSUMER.RESET of a
// subscriber's consumer, with an event's body as the request): every
// subscriber's position would be its to move.

// ReaderConsumerConfig is the one configuration of the reader consumer
// name: a durable pull consumer (no delivery subject) without acks (its
// reader tracks its own position), delivering from the start, so that a
// reset may move it to any sequence, the stream's whole subject space or
// filters. One replica in a file: it outlives a server restart, and no
// acknowledgement or delivery is replicated while a long run is read.
func ReaderConsumerConfig(name, description string, filters []string) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:        name,
		Description:    description,
		FilterSubjects: slices.Clone(filters),
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		AckPolicy:      jetstream.AckNonePolicy,
		ReplayPolicy:   jetstream.ReplayInstantPolicy,
		Replicas:       1,
	}
}

// AuditConsumerConfig is the reader consumer name (AuditConsumer or
// AuditCommandConsumer): the whole stream.
func AuditConsumerConfig(name string) jetstream.ConsumerConfig {
	return ReaderConsumerConfig(name, "fanout relay: the audit of the stream against the outbox (made by fanout provision; the relay resets it and pulls)", nil)
}

// readerField is one setting of a reader consumer that decides where its
// messages go, which ones, how fast, or whether it lives.
type readerField struct {
	name  string
	value func(jetstream.ConsumerConfig) string
}

var readerFields = []readerField{
	{"deliver_subject", func(c jetstream.ConsumerConfig) string { return orNone(c.DeliverSubject, "none (pull)") }},
	{"deliver_group", func(c jetstream.ConsumerConfig) string { return orNone(c.DeliverGroup, "none") }},
	{"flow_control", func(c jetstream.ConsumerConfig) string { return strconv.FormatBool(c.FlowControl) }},
	{"idle_heartbeat", func(c jetstream.ConsumerConfig) string { return c.IdleHeartbeat.String() }},
	{"ack_policy", func(c jetstream.ConsumerConfig) string { return c.AckPolicy.String() }},
	// A reset below a start sequence or time is refused: only "all"
	// lets the reader go anywhere.
	{"deliver_policy", func(c jetstream.ConsumerConfig) string { return c.DeliverPolicy.String() }},
	{"filter_subjects", func(c jetstream.ConsumerConfig) string {
		fs := slices.Clone(c.FilterSubjects)
		if c.FilterSubject != "" {
			fs = append(fs, c.FilterSubject)
		}
		return sortedList(fs)
	}},
	{"replay_policy", func(c jetstream.ConsumerConfig) string { return c.ReplayPolicy.String() }},
	{"rate_limit_bps", func(c jetstream.ConsumerConfig) string { return strconv.FormatUint(c.RateLimit, 10) }},
	{"headers_only", func(c jetstream.ConsumerConfig) string { return strconv.FormatBool(c.HeadersOnly) }},
	{"max_batch", func(c jetstream.ConsumerConfig) string { return strconv.Itoa(max(c.MaxRequestBatch, 0)) }},
	{"max_bytes", func(c jetstream.ConsumerConfig) string { return strconv.Itoa(max(c.MaxRequestMaxBytes, 0)) }},
	// A durable with an inactive threshold is deleted once idle, and
	// only the provisioner makes it again.
	{"inactive_threshold", func(c jetstream.ConsumerConfig) string { return c.InactiveThreshold.String() }},
	{"pause_until", func(c jetstream.ConsumerConfig) string {
		if c.PauseUntil == nil || c.PauseUntil.IsZero() {
			return "none"
		}
		return c.PauseUntil.UTC().Format(time.RFC3339)
	}},
	{"priority_policy", func(c jetstream.ConsumerConfig) string { return strconv.Itoa(int(c.PriorityPolicy)) }},
	{"mem_storage", func(c jetstream.ConsumerConfig) string { return strconv.FormatBool(c.MemoryStorage) }},
	{"num_replicas", func(c jetstream.ConsumerConfig) string { return strconv.Itoa(c.Replicas) }},
}

func orNone(s, none string) string {
	if s == "" {
		return none
	}
	return s
}

// ReaderDifferences lists the settings in which have, a live reader
// consumer's configuration, is not want, its ReaderConsumerConfig.
func ReaderDifferences(have, want jetstream.ConsumerConfig) []Difference {
	var ds []Difference
	for _, f := range readerFields {
		if h, w := f.value(have), f.value(want); h != w {
			ds = append(ds, Difference{Field: f.name, Have: h, Want: w})
		}
	}
	return ds
}

// ErrReaderDiffers is wrapped by EnsureReader's error for a reader
// consumer that exists with another configuration than its own.
var ErrReaderDiffers = errors.New("reader consumer differs from its configuration")

// EnsureReader returns the reader consumer want names on s, checked: it
// must exist with exactly want's configuration (ReaderDifferences), or it
// is refused with the differences. With provision (`fanout provision`,
// or a role with stream.provision auto) it is created when missing and
// brought to want when it differs; JetStream refuses some changes (a push
// consumer cannot become a pull one): the consumer must then be deleted by
// an administrator. Without, it changes nothing.
func EnsureReader(ctx context.Context, s jetstream.Stream, want jetstream.ConsumerConfig, provision bool) (jetstream.Consumer, error) {
	name, streamName := want.Durable, s.CachedInfo().Config.Name
	c, err := s.Consumer(ctx, name)
	var have jetstream.ConsumerConfig
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound) && provision:
		c, err = s.CreateConsumer(ctx, want)
		if errors.Is(err, jetstream.ErrConsumerExists) {
			return EnsureReader(ctx, s, want, provision) // another role made it a moment ago
		}
		if err != nil {
			return nil, fmt.Errorf("create consumer %s on stream %s: %w", name, streamName, err)
		}
		return c, nil
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		return nil, fmt.Errorf("consumer %s on stream %s does not exist: `fanout provision` makes it (this role may not): %w", name, streamName, err)
	case errors.Is(err, jetstream.ErrNotPullConsumer):
		// The client refuses to bind a push consumer; its configuration
		// says where it delivers.
		pc, perr := s.PushConsumer(ctx, name)
		if perr != nil {
			return nil, fmt.Errorf("look up consumer %s on stream %s: %w (%w)", name, streamName, err, perr)
		}
		have = pc.CachedInfo().Config
	case err != nil:
		return nil, fmt.Errorf("look up consumer %s on stream %s: %w", name, streamName, err)
	default:
		have = c.CachedInfo().Config
	}
	ds := ReaderDifferences(have, want)
	if len(ds) == 0 {
		return c, nil
	}
	if provision {
		c, err := s.UpdateConsumer(ctx, want)
		if err == nil {
			return c, nil
		}
		return nil, fmt.Errorf("consumer %s on stream %s: %w: %s; the update was refused (%w): delete it as the stream's administrator, then run fanout provision", name, streamName, ErrReaderDiffers, Join(ds), err)
	}
	return nil, fmt.Errorf("consumer %s on stream %s: %w: %s; refusing to read through it (fanout provision --check lists it)", name, streamName, ErrReaderDiffers, Join(ds))
}

// ResetReader moves the reader consumer name so that its next pull delivers
// from stream sequence seq on (the consumer sequence starts again at 1).
func ResetReader(ctx context.Context, s jetstream.Stream, name string, seq uint64) error {
	if _, err := s.ResetConsumerToSequence(ctx, name, max(seq, 1)); err != nil {
		return fmt.Errorf("reset consumer %s to sequence %d: %w", name, seq, err)
	}
	return nil
}

// ConsumerConfigOf is the configuration of consumer name on stream
// streamName, pull or push: the client binds a push consumer only as one,
// and a reader found to be one must still say where it delivers.
func ConsumerConfigOf(ctx context.Context, js jetstream.JetStream, streamName, name string) (jetstream.ConsumerConfig, error) {
	c, err := js.Consumer(ctx, streamName, name)
	if errors.Is(err, jetstream.ErrNotPullConsumer) {
		pc, err := js.PushConsumer(ctx, streamName, name)
		if err != nil {
			return jetstream.ConsumerConfig{}, err
		}
		return pc.CachedInfo().Config, nil
	}
	if err != nil {
		return jetstream.ConsumerConfig{}, err
	}
	return c.CachedInfo().Config, nil
}
