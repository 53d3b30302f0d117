package outboxstore_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5"
)

// An event type the outbox is told not to number is written without an
// aggregate_seq and leaves its aggregate's counter alone; every other
// type is numbered as before, and numbering it again goes on from the
// counter. The list reads back as set, from the trigger itself.
func TestSkippedEventTypesAreNotNumbered(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	// write writes one event of type typ for aggregate id and returns its
	// number, 0 for none.
	write := func(aggType, typ string) int64 {
		t.Helper()
		var id int64
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			var err error
			id, err = outbox.Write(ctx, tx, outbox.Event{AggregateType: aggType, AggregateID: "1", Type: typ, Payload: map[string]int{"id": 1}})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		var seq *int64
		if err := db.Pool.QueryRow(ctx, `SELECT aggregate_seq FROM outbox WHERE id = $1`, id).Scan(&seq); err != nil {
			t.Fatal(err)
		}
		if seq == nil {
			return 0
		}
		return *seq
	}
	unnumbered := func() []string {
		t.Helper()
		got, err := store.Unnumbered(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}

	if got := unnumbered(); len(got) != 0 {
		t.Fatalf("a new database skips %q, want every event numbered", got)
	}
	if n := write("product", "product.updated"); n != 1 {
		t.Fatalf("product.updated numbered %d, want 1", n)
	}

	skip := []string{"product.updated", "product.created", "product.updated"}
	if err := store.SetNumbering(ctx, skip); err != nil {
		t.Fatal(err)
	}
	if got, want := unnumbered(), []string{"product.created", "product.updated"}; !slices.Equal(got, want) {
		t.Fatalf("after skipping %q the outbox skips %q, want %q", skip, got, want)
	}
	if n := write("product", "product.updated"); n != 0 {
		t.Errorf("skipped product.updated numbered %d, want none", n)
	}
	if n := write("product", "product.repriced"); n != 2 {
		t.Errorf("product.repriced, of the same aggregate, numbered %d, want 2 (a skipped event takes no number)", n)
	}
	if n := write("order", "order.created"); n != 1 {
		t.Errorf("order.created numbered %d, want 1", n)
	}

	// A writer's transaction holds the outbox past the function's
	// lock_timeout (1 s): the change waits for it, trying again.
	held, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.Write(ctx, held, outbox.Event{AggregateType: "order", AggregateID: "2", Type: "order.created", Payload: map[string]int{"id": 2}}); err != nil {
		t.Fatal(err)
	}
	committed := make(chan error, 1)
	go func() {
		time.Sleep(2500 * time.Millisecond)
		committed <- held.Commit(ctx)
	}()
	if err := store.SetNumbering(ctx, nil); err != nil {
		t.Fatalf("numbering everything again while a writer holds the outbox: %v", err)
	}
	if err := <-committed; err != nil {
		t.Fatal(err)
	}
	if got := unnumbered(); len(got) != 0 {
		t.Fatalf("after numbering everything again the outbox skips %q", got)
	}
	if n := write("product", "product.updated"); n != 3 {
		t.Errorf("product.updated numbered again got %d, want 3", n)
	}

	// A row moved back into the outbox by the relays' retention (a
	// dropped range's failed row, status failed) keeps its number, or
	// none: a failed event written while its type was skipped is not
	// numbered after the events written since.
	var moved *int64
	if err := db.Pool.QueryRow(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status)
VALUES ('product', '1', 'product.updated', '{}', 'failed') RETURNING aggregate_seq`).Scan(&moved); err != nil {
		t.Fatal(err)
	}
	if moved != nil {
		t.Errorf("a failed row without a number, moved back into the outbox, numbered %d", *moved)
	}
	if n := write("product", "product.updated"); n != 4 {
		t.Errorf("product.updated after the move numbered %d, want 4 (the move takes no number)", n)
	}
	if _, err := db.Pool.Exec(ctx, `SELECT fanout_outbox_numbering(NULL)`); err == nil || !strings.Contains(err.Error(), "skip is NULL") {
		t.Errorf("fanout_outbox_numbering(NULL): %v, want refused", err)
	}

	for _, bad := range [][]string{{"product updated"}, {""}, {"product.>"}} {
		if err := store.SetNumbering(ctx, bad); !errors.Is(err, outbox.ErrInvalidEvent) {
			t.Errorf("skipping %q: %v, want an invalid event type", bad, err)
		}
	}
	if got := unnumbered(); len(got) != 0 {
		t.Errorf("refused lists changed the numbering: it skips %q", got)
	}
}
