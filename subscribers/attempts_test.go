package subscribers

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers/bookkeeping"
)

// Attempts are opened for redeliveries only, once per delivery; closed
// only where open; a failure closes its attempt; a runner taken for dead
// writes nothing.
func TestAttemptsOpenAndCloseTheirOwn(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	var crashed atomic.Bool
	store := bookkeeping.New(db.Pool)
	a := &attempts{store: store, name: "test", timeout: 5 * time.Second, logger: slog.New(slog.NewTextHandler(io.Discard, nil)), crashed: &crashed}
	first := &delivery{ev: Event{ID: 1}}
	again := &delivery{ev: Event{ID: 2}, mark: true}
	suspect := &delivery{ev: Event{ID: 3}, mark: true}
	states := func() map[int64]bookkeeping.AttemptState {
		t.Helper()
		st, err := a.lookup(ctx, []int64{1, 2, 3})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	for range 2 { // an attempt held through an outage is not opened twice
		if err := a.open(ctx, []*delivery{first, again, suspect}); err != nil {
			t.Fatal(err)
		}
	}
	if st := states(); st[1].HasRow || st[2].OpenAttempts != 1 || st[3].OpenAttempts != 1 || !again.opened || first.opened {
		t.Fatalf("after opening: %+v (first opened %t, again %t)", st, first.opened, again.opened)
	}
	if n, err := a.fail(ctx, suspect, errors.New("boom")); err != nil || n != 1 {
		t.Fatalf("failure counted %d (%v)", n, err)
	}
	if !a.close([]*delivery{first, again, suspect}) {
		t.Fatal("close reported attempts left open")
	}
	st := states()
	if st[2].OpenAttempts != 0 || st[3].OpenAttempts != 0 || st[3].Failures != 1 || st[3].LastError != "boom" {
		t.Fatalf("after closing: %+v", st)
	}
	if err := a.open(ctx, []*delivery{again}); err != nil {
		t.Fatal(err)
	}
	crashed.Store(true)
	if a.close([]*delivery{again}) {
		t.Fatal("a crashed runner closed its attempt")
	}
	if st := states(); st[2].OpenAttempts != 1 {
		t.Fatalf("a crashed runner's attempt: %+v, want it left open (counted as a crash)", st[2])
	}
	a.forget(ctx, []*delivery{again, suspect})
	if st := states(); st[2].HasRow || st[3].HasRow {
		t.Fatalf("after forgetting: %+v", st)
	}
}
