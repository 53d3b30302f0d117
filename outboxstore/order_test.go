package outboxstore_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5"
)

// An aggregate's events are numbered in the order their transactions
// commit: a second writer of the aggregate waits for the first to commit
// or roll back, and a rolled-back event gives its number back. Writers of
// other aggregates wait for nothing.
func TestAggregateNumbersFollowCommitOrder(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	db := pgtest.NewDB(t)
	event := func(agg string) outbox.Event {
		return outbox.Event{AggregateType: "order", AggregateID: agg, Type: "order.updated", Payload: map[string]string{"order": agg}}
	}
	seqOf := func(id int64) int64 {
		t.Helper()
		var seq int64
		if err := db.Pool.QueryRow(ctx, `SELECT aggregate_seq FROM outbox WHERE id = $1`, id).Scan(&seq); err != nil {
			t.Fatal(err)
		}
		return seq
	}

	first, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.Write(ctx, first, event("a")); err != nil {
		t.Fatal(err)
	}
	var firstPID uint32
	if err := first.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&firstPID); err != nil {
		t.Fatal(err)
	}
	// Another aggregate does not wait.
	other := writeOne(ctx, t, db, event("b"))
	if seqOf(other) != 1 {
		t.Fatalf("b's first event is number %d", seqOf(other))
	}

	second := make(chan int64, 1)
	go func() {
		id, err := writeOneErr(ctx, db, event("a"))
		if err != nil {
			t.Error(err)
		}
		second <- id
	}()
	// The second writer of a waits on the first's transaction.
	deadline := time.Now().Add(20 * time.Second)
	for {
		var waiting bool
		if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)))`, firstPID).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the second writer of aggregate a never waited for the first")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The first rolls back: the second gets number 1, no gap.
	if err := first.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if id := <-second; seqOf(id) != 1 {
		t.Fatalf("after a rolled-back event, a's event is number %d, want 1", seqOf(id))
	}

	// Writers racing on a few aggregates: each aggregate's numbers are
	// 1..n, once each.
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				if _, err := writeOneErr(ctx, db, event(fmt.Sprintf("c%d", (w+i)%3))); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	rows, err := db.Pool.Query(ctx, `SELECT aggregate_id, count(*), count(DISTINCT aggregate_seq), min(aggregate_seq), max(aggregate_seq)
FROM outbox WHERE aggregate_id LIKE 'c%' GROUP BY aggregate_id`)
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for rows.Next() {
		var agg string
		var n, distinct, lo, hi int
		if err := rows.Scan(&agg, &n, &distinct, &lo, &hi); err != nil {
			t.Fatal(err)
		}
		if distinct != n || lo != 1 || hi != n {
			t.Errorf("aggregate %s: %d events numbered %d..%d (%d distinct), want 1..%d", agg, n, lo, hi, distinct, n)
		}
		total += n
	}
	if rows.Err() != nil || total != 200 {
		t.Fatalf("%d events (%v), want 200", total, rows.Err())
	}
}

func writeOne(ctx context.Context, t *testing.T, db *pgtest.DB, e outbox.Event) int64 {
	t.Helper()
	id, err := writeOneErr(ctx, db, e)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func writeOneErr(ctx context.Context, db *pgtest.DB, e outbox.Event) (int64, error) {
	var id int64
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		id, err = outbox.Write(ctx, tx, e)
		return err
	})
	return id, err
}
