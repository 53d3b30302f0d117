package jsretry

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A cluster node down while a role starts (the fault run's cluster, a
// rolling restart) makes JetStream refuse to place a stream for a while:
// the role waits for it. Placement refused for a reason that will not pass
// is the role's error to report.
func TestTransient(t *testing.T) {
	ctx := context.Background()
	noPeers := func(desc string) error {
		return fmt.Errorf("provision stream EVENTS: %w", &jetstream.APIError{Code: 400, ErrorCode: 10005, Description: desc})
	}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{noPeers("no suitable peers for placement, peer offline"), true},
		{noPeers("no suitable peers for placement, insufficient storage"), false},
		{noPeers("no suitable peers for placement, peer offline, tags not matched ['az:x']"), false},
		{&jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}, true},
		{&jetstream.APIError{Code: 400, ErrorCode: 10058, Description: "stream name already in use with a different configuration"}, false},
		{nats.ErrNoResponders, true},
		{nats.ErrTimeout, true},
	} {
		if got := Transient(ctx, c.err); got != c.want {
			t.Errorf("Transient(%v) = %v, want %v", c.err, got, c.want)
		}
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if Transient(cancelled, nats.ErrTimeout) {
		t.Error("transient after the context ended")
	}
}
