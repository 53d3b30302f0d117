package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
)

// A role whose NATS connection is closed for good stops waiting and
// reports it (so the process exits and is restarted), while SIGTERM is a
// clean stop.
func TestRoleEndsWhenNATSClosesForGood(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	nc := srv.Connect(t)
	done := make(chan error, 1)
	go func() { done <- untilStopOrClosed(context.Background(), nc) }()
	nc.Close()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "closed for good") {
			t.Fatalf("after the connection closed: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("still waiting after the connection closed for good")
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := untilStopOrClosed(ctx, srv.Connect(t)); err != nil {
		t.Fatalf("a stop is not an error: %v", err)
	}
}
