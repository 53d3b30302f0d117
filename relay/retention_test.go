package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/wire"
)

// Retention drops whole ranges of the outbox, in both capture modes, once
// every row in them was published, and none before, even with the
// retention at 0 and NATS down; a failed row outlives its range in
// outbox_default; and every event is in the stream once.
func TestOutboxRangesDroppedAfterRetention(t *testing.T) {
	t.Parallel()
	forEachCapture(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		r := h.newRelay(func(c *Config) {
			c.SentRetention = 0
			c.CleanupInterval = 100 * time.Millisecond
		}, nil)
		// Ranges of 10 ids, below relay.partition_size's range (New
		// refuses them), so that a few hundred rows fill many.
		r.cfg.PartitionSize, r.maintainer.partitionsAhead, r.maintainer.partitionMargin = 10, 30, 10
		h.start(r)
		if h.wal() {
			h.waitStreaming(r)
		}
		waitFor(t, 10*time.Second, "the first ranges", func() (bool, string) {
			var n int
			err := h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_partitions`).Scan(&n)
			return err == nil && n > 0, fmt.Sprint(n, err)
		})
		// Ids 1..10 go to outbox_default (the margin), the rest to ranges
		// of 10 from 11; 200 ids fill the range [191, 201). The second
		// half is written while NATS is down, and its ranges fill and
		// seal before a row in them can be published: they must stay.
		for i := 0; i < 190; i += 10 {
			if i == 100 {
				h.nats.Stop()
			}
			events := make([]outbox.Event, 10)
			for j := range events {
				events[j] = productEvent(i + j + 1)
			}
			write(t, h.db.Pool, events...)
			if i == 50 {
				// A row a writer in another language inserted failed.
				var failed int64
				if err := h.db.Pool.QueryRow(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, last_error)
VALUES ('product', 'x', 'product.updated', '{}', 'failed', 'planted') RETURNING id`).Scan(&failed); err != nil || failed != 61 {
					t.Fatalf("planted failed row: id %d (%v), want 61", failed, err)
				}
			}
		}
		events := make([]outbox.Event, 9)
		for j := range events {
			events[j] = productEvent(191 + j)
		}
		write(t, h.db.Pool, events...) // ids 192..200
		time.Sleep(time.Second)        // ten retention passes
		if err := h.nats.Restart(); err != nil {
			t.Fatal(err)
		}

		waitFor(t, 30*time.Second, "every range up to id 200 dropped, and outbox_default emptied of published rows", func() (bool, string) {
			var rows, lowest int64
			var where string
			err := h.db.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM outbox),
       (SELECT coalesce(min(lower_id), 0) FROM outbox_partitions),
       coalesce((SELECT string_agg(tableoid::regclass::text || ':' || id || ':' || status, ',') FROM outbox WHERE id <= 200), '')`).Scan(&rows, &lowest, &where)
			return err == nil && rows == 1 && lowest >= 201 && where == "outbox_default:61:failed",
				fmt.Sprintf("%d rows, lowest range from %d, rows up to 200: %.200s (%v)", rows, lowest, where, err)
		})
		msgs := h.streamMessages()
		seen := map[string]int{}
		for _, m := range msgs {
			seen[m.Header.Get(wire.EventIDHeader)]++
			var p map[string]any
			if err := json.Unmarshal(m.Data, &p); err != nil {
				t.Fatalf("message %s: %v", m.Header.Get(wire.EventIDHeader), err)
			}
		}
		for id := 1; id <= 200; id++ {
			want := 1
			if id == 61 {
				want = 0
			}
			if got := seen[strconv.Itoa(id)]; got != want {
				t.Errorf("event %d is in the stream %d times, want %d", id, got, want)
			}
		}
	})
}
