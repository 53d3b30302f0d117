package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
)

// A burst of rows the statistics cannot know of (a bulk import in one
// transaction) gets the ranges that hold it analyzed by the relay, not a
// minute later by autovacuum: a claim planned with a range's statistics
// from when it was empty sorts every pending row of it per window
// (analyzeBurst). A range never analyzed has reltuples -1.
func TestABurstGetsItsRangesAnalyzed(t *testing.T) {
	t.Parallel()
	const n = 600
	h := newHarness(t)
	r := h.newRelay(func(c *Config) { c.BatchSize, c.MaxInFlight = 20, 20 }, nil)
	r.partitionMargin = 10 // the rows in a range, not in outbox_default
	h.start(r)
	ctx := context.Background()
	write(t, h.db.Pool, productEvent(0)) // the relay is running, its ranges made
	h.waitAllSent(1, 10*time.Second)

	tuples := func(id int64) (float64, string) {
		var name string
		var reltuples float64
		if err := h.db.Pool.QueryRow(ctx, `
SELECT p.name, c.reltuples FROM outbox_partitions p JOIN pg_class c ON c.oid = p.name::regclass
WHERE $1 >= coalesce(p.lower_id, $1) AND $1 < p.upper_id`, id).Scan(&name, &reltuples); err != nil {
			t.Fatal(err)
		}
		return reltuples, name
	}
	var before float64
	if err := h.db.Pool.QueryRow(ctx, `
SELECT max(c.reltuples) FROM outbox_partitions p JOIN pg_class c ON c.oid = p.name::regclass`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if before >= n {
		t.Fatalf("a range counts %.0f rows before the burst: the test proves less than it claims", before)
	}
	// Test databases are new, and autovacuum visits a new database at
	// once: it would analyze the range itself.
	if _, err := h.db.Pool.Exec(ctx, `
DO $$ DECLARE p text; BEGIN
    FOR p IN SELECT name FROM outbox_partitions LOOP
        EXECUTE format('ALTER TABLE %I SET (autovacuum_enabled = false)', p);
    END LOOP;
END $$`); err != nil {
		t.Fatal(err)
	}

	events := make([]outbox.Event, n)
	for i := range events {
		events[i] = productEvent(i + 1) // an aggregate per event: every row a head
	}
	ids := write(t, h.db.Pool, events...)
	_, name := tuples(ids[n-1])
	var rows float64
	if err := h.db.Pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %q`, name)).Scan(&rows); err != nil || rows < n/2 {
		t.Fatalf("range %s holds %.0f rows (%v), want most of the burst's %d", name, rows, err, n)
	}
	waitFor(t, 20*time.Second, "the burst's range analyzed", func() (bool, string) {
		got, _ := tuples(ids[n-1])
		return got == rows, fmt.Sprintf("range %s: reltuples %.0f, want its %.0f rows", name, got, rows)
	})
	h.waitAllSent(n+1, 20*time.Second)
}
