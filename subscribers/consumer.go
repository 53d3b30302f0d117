package subscribers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go/jetstream"
)

// ConsumerConfig is the durable consumer the subscriber name gets, for its
// event types.
// An ordered subscriber's consumer pins one instance at a time (a priority
// group with the pinned-client policy).
func ConsumerConfig(name string, eventTypes []string, ordered bool, cfg Config, stream stream.Config) jetstream.ConsumerConfig {
	filters := make([]string, 0, len(eventTypes))
	for _, t := range eventTypes {
		filters = append(filters, stream.SubjectPrefix+"."+t)
	}
	cc := jetstream.ConsumerConfig{
		Durable:        name,
		Description:    "fanout subscriber " + name + ": " + strings.Join(filters, ", "),
		FilterSubjects: filters,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        cfg.AckWait,
		// Unlimited: the server's delivery count also counts deliveries lost
		// to an outage (or a crash), which must never push an event out.
		// The runtime decides when an event has had enough, from its own
		// count of the handler's failures (subscribers.max_failures) and of
		// the processes that died handling it (subscribers.max_crashes).
		MaxDeliver:    -1,
		MaxAckPending: cfg.MaxAckPending,
		Replicas:      stream.Replicas,
		Metadata:      map[string]string{"fanout.subscriber": name},
	}
	if ordered {
		cc.PriorityPolicy = jetstream.PriorityPolicyPinned
		cc.PriorityGroups = []string{orderedGroup}
		cc.PinnedTTL = cfg.pinnedTTL()
		cc.Metadata["fanout.ordered"] = "true"
	}
	switch cfg.Start {
	case "new":
		cc.DeliverPolicy = jetstream.DeliverNewPolicy
	case "time":
		t, _ := time.Parse(time.RFC3339, cfg.StartTime) // validated by config
		cc.DeliverPolicy = jetstream.DeliverByStartTimePolicy
		cc.OptStartTime = &t
	default:
		cc.DeliverPolicy = jetstream.DeliverAllPolicy
	}
	return cc
}

// ensureConsumer creates the consumer or brings it to want (auto), checks it
// (verify), or only binds it (off). The start position of an existing
// consumer is kept: JetStream cannot change it, and it only mattered when the
// subscriber was new.
func ensureConsumer(ctx context.Context, stream jetstream.Stream, want jetstream.ConsumerConfig, provision string) (jetstream.Consumer, error) {
	existing, err := stream.Consumer(ctx, want.Durable)
	if err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, fmt.Errorf("look up consumer %s: %w", want.Durable, err)
	}
	switch provision {
	case "off":
		if existing == nil {
			return nil, fmt.Errorf("consumer %s does not exist (stream.provision=off)", want.Durable)
		}
		return existing, nil
	case "verify":
		if existing == nil {
			return nil, fmt.Errorf("consumer %s does not exist (stream.provision=verify; `fanout provision` creates it)", want.Durable)
		}
		have := existing.CachedInfo().Config
		if have.AckPolicy != jetstream.AckExplicitPolicy {
			return nil, fmt.Errorf("consumer %s: ack policy %s, want explicit", want.Durable, have.AckPolicy)
		}
		if !sameSet(have.FilterSubjects, want.FilterSubjects) && !(have.FilterSubject != "" && sameSet([]string{have.FilterSubject}, want.FilterSubjects)) {
			return nil, fmt.Errorf("consumer %s filters %v, the subscriber wants %v", want.Durable, have.FilterSubjects, want.FilterSubjects)
		}
		if have.PriorityPolicy != want.PriorityPolicy || !slices.Equal(have.PriorityGroups, want.PriorityGroups) {
			return nil, fmt.Errorf("consumer %s pins an instance: %t (groups %v), the subscriber wants %t (groups %v): an ordered subscriber pins one instance at a time, an unordered one none",
				want.Durable, have.PriorityPolicy == jetstream.PriorityPolicyPinned, have.PriorityGroups, want.PriorityPolicy == jetstream.PriorityPolicyPinned, want.PriorityGroups)
		}
		return existing, nil
	}
	if existing != nil {
		have := existing.CachedInfo().Config
		want.DeliverPolicy, want.OptStartTime, want.OptStartSeq = have.DeliverPolicy, have.OptStartTime, have.OptStartSeq
		c, err := stream.UpdateConsumer(ctx, want)
		if err != nil {
			return nil, fmt.Errorf("update consumer %s: %w", want.Durable, err)
		}
		return c, nil
	}
	c, err := stream.CreateConsumer(ctx, want)
	if errors.Is(err, jetstream.ErrConsumerExists) {
		// Another instance created it a moment ago.
		return ensureConsumer(ctx, stream, want, provision)
	}
	if err != nil {
		return nil, fmt.Errorf("create consumer %s: %w", want.Durable, err)
	}
	return c, nil
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// ProvisionConsumer creates the subscriber's durable consumer or brings it
// to its configuration (keeping the start position of an existing one):
// `fanout provision` runs it with the provisioning identity, so that the
// subscribers themselves need no right to create or change consumers.
func ProvisionConsumer(ctx context.Context, stream jetstream.Stream, d Declaration, cfg Config, streamCfg stream.Config) (jetstream.Consumer, error) {
	return ensureConsumer(ctx, stream, ConsumerConfig(d.Name, d.EventTypes, d.Ordered, cfg, streamCfg), "auto")
}
