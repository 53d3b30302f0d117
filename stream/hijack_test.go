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
		{"into another's pull", at("$JS.API.CONSUMER.MSG.NEXT.EVENTS.salesledger", 12, 0), []string{"deliver_subject"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ds := stream.HijackMarks(tc.info, "events")
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

// A consumer past the stream's end is marked at the second check in a row
// that finds it there (a cluster's leaders may disagree for a moment), and
// no longer once it is back or gone.
func TestPastTheEndWatch(t *testing.T) {
	at := func(name string, delivered, ackFloor uint64) *jetstream.ConsumerInfo {
		return &jetstream.ConsumerInfo{Name: name, Delivered: jetstream.SequenceInfo{Stream: delivered}, AckFloor: jetstream.SequenceInfo{Stream: ackFloor}}
	}
	var w stream.PastTheEndWatch
	marked := func(round map[string][]stream.Difference) []string {
		var names []string
		for n := range round {
			names = append(names, n)
		}
		slices.Sort(names)
		return names
	}
	for i, step := range []struct {
		infos   []*jetstream.ConsumerInfo
		lastSeq uint64
		want    []string
	}{
		{[]*jetstream.ConsumerInfo{at("keeping", 10, 9), at("moved", 1_000_000, 0), at("acked", 5, 11), at("blip", 12, 12)}, 10, nil},
		{[]*jetstream.ConsumerInfo{at("keeping", 10, 9), at("moved", 1_000_000, 0), at("acked", 5, 11), at("blip", 12, 12)}, 12, []string{"moved"}},
		{[]*jetstream.ConsumerInfo{at("keeping", 10, 9), at("moved", 1_000_000, 0), at("acked", 5, 11), at("blip", 12, 12)}, 10, []string{"moved"}},
		{[]*jetstream.ConsumerInfo{at("keeping", 10, 9), at("acked", 5, 11), at("blip", 12, 12)}, 10, []string{"acked", "blip"}},
		{[]*jetstream.ConsumerInfo{at("moved", 1_000_000, 0)}, 10, nil},
	} {
		if got := marked(w.Round(step.infos, step.lastSeq)); !slices.Equal(got, step.want) {
			t.Errorf("round %d: marked %v, want %v", i+1, got, step.want)
		}
	}
	if ds := w.Held("moved"); ds != nil {
		t.Errorf("held %v for a consumer the last round did not mark", ds)
	}
	w.Round([]*jetstream.ConsumerInfo{at("moved", 1_000_000, 0)}, 10)
	if ds := w.Held("moved"); len(ds) != 1 || ds[0].Field != "delivered.stream_seq" {
		t.Errorf("held %v, want the mark the last round reported", ds)
	}
}
