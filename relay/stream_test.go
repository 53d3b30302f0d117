package relay

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go/jetstream"
)

func TestStreamProvisioning(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	js, err := jetstream.New(h.connect())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	logger := testLogger(t)
	minDup := RepublishDelay(h.cfg.Relay)

	verify := h.cfg.Stream
	verify.Provision = "verify"
	if err := stream.Ensure(ctx, js, verify, minDup, logger); err == nil {
		t.Fatal("verify passed with no stream")
	}

	if err := stream.Ensure(ctx, js, h.cfg.Stream, minDup, logger); err != nil {
		t.Fatalf("auto: %v", err)
	}
	s, err := js.Stream(ctx, h.cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	c := s.CachedInfo().Config
	if c.Storage != jetstream.FileStorage || c.Retention != jetstream.LimitsPolicy || c.MaxAge != h.cfg.Stream.MaxAge ||
		c.Duplicates != h.cfg.Stream.DuplicateWindow || c.Subjects[0] != "events.>" || c.Description == "" || c.Metadata["fanout.msg_id"] != "<Fanout-Origin>:<outbox.id>" {
		t.Errorf("provisioned stream config: %+v", c)
	}
	if err := stream.Ensure(ctx, js, verify, minDup, logger); err != nil {
		t.Fatalf("verify after auto: %v", err)
	}
	// Events leave by age only: no API call deletes or purges them.
	if !c.DenyDelete || !c.DenyPurge {
		t.Errorf("provisioned stream allows deletes (%v) or purges (%v)", !c.DenyDelete, !c.DenyPurge)
	}
	if err := s.Purge(ctx); err == nil {
		t.Error("the events stream was purged")
	}

	// A stream owned by other tooling with a window too short for the lease.
	c.Duplicates = time.Minute
	if _, err := js.UpdateStream(ctx, c); err != nil {
		t.Fatal(err)
	}
	err = stream.Ensure(ctx, js, verify, minDup, logger)
	if !errors.Is(err, stream.ErrUnfit) || !strings.Contains(err.Error(), "1m0s") || !strings.Contains(err.Error(), minDup.String()) {
		t.Fatalf("verify with a short duplicates window: %v; want stream.ErrUnfit naming both durations", err)
	}

	off := h.cfg.Stream
	off.Provision = "off"
	if err := stream.Ensure(ctx, js, off, minDup, logger); err != nil {
		t.Fatalf("off: %v", err)
	}
}
