package stream

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestStreamDifferences(t *testing.T) {
	want := JetStreamConfig(DefaultConfig())
	// The server spells out what fanout leaves to its defaults.
	have := want
	have.MaxConsumers, have.MaxMsgSize, have.MaxMsgsPerSubject, have.Replicas = -1, -1, -1, 1
	have.Description, have.Metadata = "changed by hand", map[string]string{"_nats.ver": "2.15.2"}
	if ds := StreamDifferences(have, want); len(ds) != 0 {
		t.Fatalf("the same stream as the server reports it: %s", Join(ds))
	}
	for _, c := range []struct {
		change func(*jetstream.StreamConfig)
		field  string
		lowers bool
	}{
		{func(c *jetstream.StreamConfig) { c.MaxAge = 0 }, "max_age", true},          // from unlimited to 7 days
		{func(c *jetstream.StreamConfig) { c.MaxAge = time.Hour }, "max_age", false}, // back to 7 days
		{func(c *jetstream.StreamConfig) { c.MaxMsgs = 1 }, "max_msgs", false},
		{func(c *jetstream.StreamConfig) { c.MaxBytes = 10 << 40 }, "max_bytes", false},
		{func(c *jetstream.StreamConfig) { c.Duplicates = time.Hour }, "duplicate_window", true},
		{func(c *jetstream.StreamConfig) { c.Replicas = 3 }, "num_replicas", true},
		{func(c *jetstream.StreamConfig) { c.DenyPurge = false }, "deny_purge", false},
		{func(c *jetstream.StreamConfig) { c.AllowRollup = true }, "allow_rollup_hdrs", false},
		{func(c *jetstream.StreamConfig) { c.Subjects = []string{"events.>", "_R_.>"} }, "subjects", false},
		{func(c *jetstream.StreamConfig) {
			c.RePublish = &jetstream.RePublish{Source: ">", Destination: "copy.>"}
		}, "republish", false},
	} {
		have := want
		c.change(&have)
		ds := StreamDifferences(have, want)
		if len(ds) != 1 || ds[0].Field != c.field || ds[0].Lowers != c.lowers {
			t.Errorf("a stream with %s changed: %v, want one difference in it (lowers %t)", c.field, ds, c.lowers)
		}
	}
}
