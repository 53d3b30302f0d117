package relay

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// The stream's limits remove its oldest events (a max_msgs set for a
// moment stands in for max_age here). Events removed before a consumer whose
// filter names them acknowledged them are missing for its subscriber: the
// audit publishes them again, and that consumer then gets every event.
// Removed after every such consumer acknowledged them (a consumer that
// filters them out does not count), they are only aged out.
func TestAuditRepublishesWhatAgedOutBeforeAConsumerAckedIt(t *testing.T) {
	t.Parallel()
	const events, purged = 20, 10
	for _, behind := range []bool{true, false} {
		name := "consumer-behind"
		if !behind {
			name = "every-consumer-done"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			r := h.newRelay(nil, nil)
			h.start(r)
			writeMany(t, h.db.Pool, events)
			h.waitAllSent(events, 30*time.Second)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := r.Stop(ctx); err != nil {
				t.Fatal(err)
			}

			js, err := jetstream.New(h.connect())
			if err != nil {
				t.Fatal(err)
			}
			s, err := js.Stream(ctx, h.cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			consumer := func(name, filter string) jetstream.Consumer {
				c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name, FilterSubject: filter, AckPolicy: jetstream.AckExplicitPolicy})
				if err != nil {
					t.Fatal(err)
				}
				return c
			}
			ackAll := func(c jetstream.Consumer, n int) {
				batch, err := c.FetchNoWait(n)
				if err != nil {
					t.Fatal(err)
				}
				got := 0
				for m := range batch.Messages() {
					if err := m.DoubleAck(ctx); err != nil {
						t.Fatal(err)
					}
					got++
				}
				if got != n {
					t.Fatalf("%d messages fetched, want %d", got, n)
				}
			}
			done := consumer("done", "events.product.>")
			late := consumer("late", "events.product.updated")
			consumer("orders", "events.order.>") // never acks: none of its business
			ackAll(done, events)
			if !behind {
				ackAll(late, events)
			}
			// A limit the oldest events exceed, then the stream as it was
			// but for a duplicate window short enough to wait out.
			const window = 2 * time.Second
			cfg := s.CachedInfo().Config
			cfg.Duplicates = window
			for _, max := range []int64{events - purged, -1} {
				cfg.MaxMsgs = max
				if _, err := js.UpdateStream(ctx, cfg); err != nil {
					t.Fatal(err)
				}
			}
			if info, err := s.Info(ctx); err != nil || info.State.FirstSeq != purged+1 {
				t.Fatalf("after the limit the stream begins at %+v (%v), want %d", info.State, err, purged+1)
			}

			opts := Options{Relay: h.cfg.Relay, Stream: h.cfg.Stream, Pool: h.db.Pool, Conn: h.connect(), Logger: testLogger(t)}
			rep, err := Audit(ctx, opts, time.Now().Add(-time.Hour), false, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !behind {
				if rep.AgedOut != purged || rep.AgedUnconsumed != 0 || rep.Missing != 0 {
					t.Fatalf("audit: %+v, want %d aged out and nothing missing", rep, purged)
				}
				return
			}
			// Within the stream's duplicate window JetStream would drop them
			// as duplicates of themselves: missing, not repaired yet.
			if rep.AgedUnconsumed != purged || rep.Missing != purged || rep.Repaired != 0 || rep.AgedOut != 0 {
				t.Fatalf("audit within the duplicate window: %+v, want the %d events the late consumer never had missing, none repaired", rep, purged)
			}
			time.Sleep(window)
			if rep, err = Audit(ctx, opts, time.Now().Add(-time.Hour), false, nil); err != nil {
				t.Fatal(err)
			}
			if rep.AgedUnconsumed != purged || rep.Missing != purged || rep.Repaired != purged || rep.AgedOut != 0 {
				t.Fatalf("audit: %+v, want the %d events the late consumer never had missing and repaired", rep, purged)
			}
			// The late consumer gets every event now: the 10 kept and the
			// 10 published again.
			ids := map[string]bool{}
			batch, err := late.Fetch(2*events, jetstream.FetchMaxWait(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			for m := range batch.Messages() {
				ids[m.Headers().Get(jetstream.MsgIDHeader)] = true
			}
			if len(ids) != events {
				t.Fatalf("the late consumer got %d distinct events, want all %d", len(ids), events)
			}
		})
	}
}
