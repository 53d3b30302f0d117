package relay

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// An event in the stream under its identity with other content than its
// row's (published there first by whoever holds the relay's credential:
// JetStream keeps it, and takes the relay's own for a duplicate) is found
// by its range's audit, which names it, keeps the range, and fails the
// audit command; the range without one is dropped as before. Here event
// 12 comes with another payload and event 13 under another event type.
func TestARangeWithAlteredEventsIsKept(t *testing.T) {
	t.Parallel()
	for _, capture := range []string{CapturePoll, CaptureWAL} {
		t.Run(capture, func(t *testing.T) {
			t.Parallel()
			testARangeWithAlteredEvents(t, capture)
		})
	}
}

func testARangeWithAlteredEvents(t *testing.T, capture string) {
	h := newHarness(t)
	h.cfg.Relay.Capture = capture
	ctx := context.Background()
	ranges := func() []string {
		rows, err := h.db.Pool.Query(ctx, `SELECT name FROM outbox_partitions WHERE upper_id <= 31 ORDER BY upper_id`)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for rows.Next() {
			var n string
			if err := rows.Scan(&n); err != nil {
				t.Fatal(err)
			}
			names = append(names, n)
		}
		return names
	}
	a := smallRanges(h.newRelay(nil, nil))
	a.hooks = testhooks.Relay{NoAudit: true}
	h.start(a)
	waitFor(t, 10*time.Second, "the first ranges", func() (bool, string) { return len(ranges()) == 2, fmt.Sprint(ranges()) })
	kept := ranges()[0] // ids 11..20

	ident, err := outboxstore.New(h.db.Pool).ReadIdentity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(h.connect())
	if err != nil {
		t.Fatal(err)
	}
	for id, subject := range map[int64]string{12: "product.updated", 13: "product.deleted"} {
		msg := nats.NewMsg(stream.Subject(h.cfg.Stream.SubjectPrefix, subject))
		msg.Data = []byte(fmt.Sprintf(`{"product_id": %d, "price_cents": 1}`, id))
		if _, err := js.PublishMsg(ctx, msg, jetstream.WithMsgID(wire.MsgID(ident.OriginOf(id), id))); err != nil {
			t.Fatal(err)
		}
	}
	writeProductsByTen(t, h, 40)
	waitFor(t, 20*time.Second, "40 events in the stream", func() (bool, string) { return h.streamCount() == 40, fmt.Sprint(h.streamCount()) })
	stop, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := a.Stop(stop); err != nil {
		t.Fatal(err)
	}

	obs := &auditCounter{}
	h.start(smallRanges(h.newRelay(nil, obs)))
	waitFor(t, 30*time.Second, "the clean range dropped", func() (bool, string) {
		left := ranges()
		return len(left) == 1, fmt.Sprint(left)
	})
	var detail string
	waitFor(t, 30*time.Second, "the kept range's audit recorded", func() (bool, string) {
		err := h.db.Pool.QueryRow(ctx, `SELECT detail FROM outbox_audits WHERE kind = 'range' AND scope = $1 ORDER BY finished_at DESC LIMIT 1`,
			"range "+kept).Scan(&detail)
		return err == nil, fmt.Sprint(err)
	})
	if !strings.Contains(detail, "2 altered") || !strings.Contains(detail, "12") || !strings.Contains(detail, "13") {
		t.Errorf("the audit of range %s says %q, want events 12 and 13 altered", kept, detail)
	}
	if n := obs.altered.Load(); n < 2 {
		t.Errorf("fanout_relay_audit_altered_total went up by %d, want 2 or more (each audit of the kept range counts them)", n)
	}
	time.Sleep(time.Second) // ten retention passes
	if left := ranges(); len(left) != 1 || left[0] != kept {
		t.Fatalf("ranges left: %v, want %s kept", left, kept)
	}

	// fanout audit's: the same finding, as an error.
	rep, err := Audit(ctx, Options{Relay: h.cfg.Relay, Stream: h.cfg.Stream, Pool: h.db.Pool, Conn: h.connect(), Logger: testLogger(t)}, time.Time{}, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Altered != 2 || rep.Missing != 0 {
		t.Errorf("fanout audit: %d altered, %d missing; want 2 altered, none missing", rep.Altered, rep.Missing)
	}
}
