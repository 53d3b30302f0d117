package stream_test

import (
	"testing"

	"github.com/fanout/fanout/stream"
)

func TestSubjectMatches(t *testing.T) {
	for _, c := range []struct {
		filter, subject string
		want            bool
	}{
		{"events.order.created", "events.order.created", true},
		{"events.order.created", "events.order.paid", false},
		{"events.order.*", "events.order.paid", true},
		{"events.order.*", "events.order", false},
		{"events.order.*", "events.order.paid.late", false},
		{"events.>", "events.order.paid", true},
		{"events.>", "events", false},
		{"events.*.paid", "events.order.paid", true},
		{"events.*.paid", "events.order.created", false},
		{"*.>", "events.x", true},
		{">", "events", true},
		{"events", "events.order", false},
		{"events.order", "events", false},
	} {
		if got := stream.SubjectMatches(c.filter, c.subject); got != c.want {
			t.Errorf("SubjectMatches(%q, %q) = %t, want %t", c.filter, c.subject, got, c.want)
		}
	}
}
