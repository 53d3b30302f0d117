package stream_test

import (
	"slices"
	"testing"

	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go/jetstream"
)

func TestHijackMarks(t *testing.T) {
	at := func(deliver string, delivered, ackFloor uint64) *jetstream.ConsumerInfo {
		return &jetstream.ConsumerInfo{Config: jetstream.ConsumerConfig{DeliverSubject: deliver},
			Delivered: jetstream.SequenceInfo{Stream: delivered}, AckFloor: jetstream.SequenceInfo{Stream: ackFloor}}
	}
	for _, tc := range []struct {
		name   string
		info   *jetstream.ConsumerInfo
		fields []string
	}{
		{"a pull consumer keeping up", at("", 10, 9), nil},
		{"a push consumer into an inbox (nats stream view)", at("_INBOX.abc", 10, 0), nil},
		{"into a subscriber's reset", at("$JS.API.CONSUMER.RESET.EVENTS.invoicing", 3, 0), []string{"deliver_subject"}},
		{"into acks", at("$JS.ACK.EVENTS.invoicing.1.2.3.4.5", 3, 0), []string{"deliver_subject"}},
		{"into the system account", at("$SYS.REQ.SERVER.PING", 3, 0), []string{"deliver_subject"}},
		{"into the stream's subjects", at("events.order.created", 3, 0), []string{"deliver_subject"}},
		{"another stream's subjects", at("deadletterx.a", 3, 0), nil},
		{"at the last message", at("", 10, 10), nil},
		{"delivered past the last message", at("", 1_000_000, 0), []string{"delivered.stream_seq"}},
		{"acked past it", at("", 5, 11), []string{"delivered.stream_seq"}},
		{"both", at("$JS.API.CONSUMER.MSG.NEXT.EVENTS.salesledger", 12, 0), []string{"deliver_subject", "delivered.stream_seq"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ds := stream.HijackMarks(tc.info, "events", 10)
			var fields []string
			for _, d := range ds {
				fields = append(fields, d.Field)
			}
			if !slices.Equal(fields, tc.fields) {
				t.Errorf("marks %v (%s), want %v", fields, stream.Join(ds), tc.fields)
			}
		})
	}
}
