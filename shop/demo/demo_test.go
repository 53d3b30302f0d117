package demo_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/shop/demo"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// drive runs a driver with mix until it has committed n writes, or fails
// the test after a deadline.
func drive(t *testing.T, pool *pgxpool.Pool, mix demo.Mix, n int64) *demo.Driver {
	t.Helper()
	d := &demo.Driver{Pool: pool, Rate: 200, Mix: mix, Rand: rand.New(rand.NewPCG(5, 5)), Logger: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	deadline := time.Now().Add(20 * time.Second)
	for d.Written() < n && d.Failed() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if d.Failed() > 0 || d.Written() < n {
		t.Fatalf("driver: %d written, %d failed; want %d written, none failed", d.Written(), d.Failed(), n)
	}
	return d
}

func eventTypes(t *testing.T, pool *pgxpool.Pool, after int64) map[string]int {
	t.Helper()
	rows, _ := pool.Query(context.Background(), `SELECT event_type FROM outbox WHERE id > $1`, after)
	types, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, ty := range types {
		out[ty]++
	}
	return out
}

// The RenameCategory share renames categories through shop.RenameCategory
// (one category.updated event each), keeping each name's root; a mix
// without it renames none.
func TestDriverRenamesCategories(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 30, rand.New(rand.NewPCG(1, 2))); err != nil {
		t.Fatal(err)
	}
	var seeded int64
	if err := db.Pool.QueryRow(ctx, `SELECT max(id) FROM outbox`).Scan(&seeded); err != nil {
		t.Fatal(err)
	}
	d := drive(t, db.Pool, demo.Mix{RenameCategory: 100}, 10)
	types := eventTypes(t, db.Pool, seeded)
	if len(types) != 1 || int64(types[shop.CategoryUpdated]) != d.Written() {
		t.Errorf("events of %d category renames: %v", d.Written(), types)
	}
	rows, _ := db.Pool.Query(ctx, `SELECT name FROM categories`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	renamed := 0
	for _, n := range names {
		root, _, cut := strings.Cut(n, " ")
		if cut {
			renamed++
		}
		if root == "" || strings.ContainsAny(root, "0123456789") {
			t.Errorf("category %q lost its root", n)
		}
	}
	if renamed == 0 {
		t.Errorf("no category renamed: %v", names)
	}

	var before int64
	if err := db.Pool.QueryRow(ctx, `SELECT max(id) FROM outbox`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	drive(t, db.Pool, demo.Mix{Price: 50, Stock: 50}, 10)
	if types := eventTypes(t, db.Pool, before); types[shop.CategoryUpdated] != 0 || types[shop.BrandUpdated] != 0 {
		t.Errorf("a mix without renames renamed: %v", types)
	}
}

// DefaultMix shares out all of the writes, category renames included.
func TestDefaultMixSumsTo100(t *testing.T) {
	m := demo.DefaultMix
	if sum := m.Price + m.Stock + m.Order + m.Create + m.Delete + m.RenameBrand + m.RenameCategory + m.Lifecycle; sum != 100 || m.RenameCategory == 0 || m.Lifecycle == 0 {
		t.Errorf("DefaultMix %+v sums to %d, want 100 with some category renames and order transitions", m, sum)
	}
}
