package relay

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
)

// A wal relay stopped gracefully lets its chunks in flight finish: one
// held until the stop begins, and the next event of its aggregate, which
// waits for it, publish, and the slot is confirmed past every transaction
// published, so the poll relay taking over publishes none of them again.
// Abandoned at the stop, the waiting chunk stopped the confirmation at its
// transaction, and the transactions after it, published, were published
// again by the next relay (TestSwitchingCaptureUnderLoad saw 8 so under
// load).
func TestAWALRelayStoppedGracefullyFinishesItsChunksInFlight(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.cfg.Relay.Capture = CaptureWAL
	walRec := &recorder{}
	wal := h.newRelay(nil, walRec)
	// Every chunk holding a held row waits, not only the first: in a CI
	// run with empty caches the held transaction was published before
	// the stop (4 published, not 3), most likely decoded again after the
	// slot's stream restarted under load.
	wal.wal.testHookChunk = func(rows []row) {
		if slices.ContainsFunc(rows, func(rw row) bool { return rw.AggregateID == "held" }) {
			<-wal.stopping
			time.Sleep(200 * time.Millisecond) // the stop cancels its soft context just after
		}
	}
	h.start(wal)
	h.waitStreaming(wal)

	held := productEvent(0)
	held.AggregateID = "held"
	ids := write(t, h.db.Pool, held)
	ids = append(ids, write(t, h.db.Pool, held)...) // waits for the first
	for i := 1; i <= 3; i++ {
		ids = append(ids, write(t, h.db.Pool, productEvent(i))...)
	}
	waitFor(t, 30*time.Second, "the transactions after the held one published", func() (bool, string) {
		published, _ := walRec.snapshot()
		return len(published) == 3, fmt.Sprintf("%d published", len(published))
	})

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := wal.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if published, _ := walRec.snapshot(); len(published) != len(ids) {
		t.Errorf("the wal relay published %d of the %d events by the end of its graceful stop, want all: its chunks in flight finish", len(published), len(ids))
	}

	h.cfg.Relay.Capture = CapturePoll
	pollRec := &recorder{}
	h.startRelay(nil, pollRec)
	waitFor(t, 30*time.Second, "every row sent", func() (bool, string) {
		c := statusCounts(t, h.db.Pool)
		return c["sent"] == len(ids), formatCounts(c)
	})
	if again, _ := pollRec.snapshot(); len(again) != 0 {
		t.Errorf("the poll relay taking over published %d events again (%+v), want none: the wal relay's stop confirmed them", len(again), again)
	}
}
