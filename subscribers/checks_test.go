package subscribers_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
)

// A subscriber whose consumer was moved past the stream's last message (a
// reset to a sequence not yet written: it would skip every event up to
// there and report nothing pending) is not ready, saying so, until its
// consumer is back within the stream.
func TestASubscriberMovedPastTheStreamsEndIsNotReady(t *testing.T) {
	t.Parallel()
	env := subscribertest.NewEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r := env.StartRunner(subscribertest.Declare("skipped", subscribers.Each(&countingHandler{}), "test.>"), func(o *subscribers.Options) {
		// Each check may take up to its interval: under load, a
		// shorter one would see every check cut short.
		o.Stream.CheckInterval = time.Second
	})
	env.Write(func(pgx.Tx) ([]outbox.Event, error) {
		return []outbox.Event{{AggregateType: "test", AggregateID: "1", Type: "test.skip", Payload: map[string]int{"n": 1}}}, nil
	})
	env.WaitIdle("skipped", 15*time.Second)
	subscribertest.WaitFor(t, 45*time.Second, "ready", func() (bool, string) { return r.Ready() == nil, errText(r.Ready()) })

	if _, err := env.JS.ResetConsumerToSequence(ctx, env.Config.Stream.Name, "skipped", 1_000_000); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, 45*time.Second, "not ready, moved past the end", func() (bool, string) {
		err := r.Ready()
		return err != nil && strings.Contains(err.Error(), "consumer skipped: delivered.stream_seq is 999999"), errText(err)
	})
	if _, err := env.JS.ResetConsumerToSequence(ctx, env.Config.Stream.Name, "skipped", 1); err != nil {
		t.Fatal(err)
	}
	subscribertest.WaitFor(t, 45*time.Second, "ready again", func() (bool, string) { return r.Ready() == nil, errText(r.Ready()) })
}
