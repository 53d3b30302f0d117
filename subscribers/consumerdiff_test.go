package subscribers_test

import (
	"testing"
	"time"

	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/nats-io/nats.go/jetstream"
)

// Each setting that changes what a subscriber's consumer delivers, to
// whom or how fast is a difference on its own, however a provisioner
// changed it (replay_policy original slowed a subscriber unnoticed); what
// the server adds to the metadata itself is not.
func TestConsumerDifferencesNameEachSetting(t *testing.T) {
	want := subscribers.ConsumerConfig("invoicing", []string{"order.created"}, false, subscribers.DefaultConfig(), stream.DefaultConfig())
	if ds := stream.ConsumerDifferences(want, want); len(ds) != 0 {
		t.Fatalf("a consumer as fanout makes it differs: %v", ds)
	}
	for field, change := range map[string]func(*jetstream.ConsumerConfig){
		"replay_policy":   func(c *jetstream.ConsumerConfig) { c.ReplayPolicy = jetstream.ReplayOriginalPolicy },
		"flow_control":    func(c *jetstream.ConsumerConfig) { c.FlowControl = true },
		"idle_heartbeat":  func(c *jetstream.ConsumerConfig) { c.IdleHeartbeat = 5 * time.Second },
		"deliver_group":   func(c *jetstream.ConsumerConfig) { c.DeliverGroup = "elsewhere" },
		"deliver_subject": func(c *jetstream.ConsumerConfig) { c.DeliverSubject = "$JS.API.CONSUMER.RESET.EVENTS.salesledger" },
		"metadata":        func(c *jetstream.ConsumerConfig) { c.Metadata = map[string]string{"fanout.subscriber": "salesledger"} },
	} {
		have := want
		have.Metadata = map[string]string{}
		for k, v := range want.Metadata {
			have.Metadata[k] = v
		}
		change(&have)
		ds := stream.ConsumerDifferences(have, want)
		if len(ds) != 1 || ds[0].Field != field {
			t.Errorf("%s changed: differences %v, want %s alone", field, ds, field)
		}
	}
	served := want
	served.Metadata = map[string]string{"_nats.ver": "2.15.2", "_nats.level": "3"}
	for k, v := range want.Metadata {
		served.Metadata[k] = v
	}
	if ds := stream.ConsumerDifferences(served, want); len(ds) != 0 {
		t.Errorf("the server's own metadata counted as a difference: %v", ds)
	}
}
