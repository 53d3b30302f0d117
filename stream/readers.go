package stream

import (
	"context"
	"errors"
	"fmt"
	"slices"

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
