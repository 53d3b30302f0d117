package schema_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/fanout/fanout/schema"
	"github.com/fanout/fanout/schema/pgtest"
)

// emptyDB is a fresh database with no migrations applied.
func emptyDB(t *testing.T) *pgtest.DB {
	db := pgtest.NewDB(t)
	// pgtest databases come migrated; drop everything to start from nothing
	// (a publication belongs to the database, not to the schema).
	_, err := db.Pool.Exec(context.Background(), `DROP SCHEMA public CASCADE; CREATE SCHEMA public; DROP PUBLICATION IF EXISTS fanout_outbox`)
	if err != nil {
		t.Fatal(err)
	}
	return db
}

func TestMigrateTwiceAndConcurrently(t *testing.T) {
	t.Parallel()
	db := emptyDB(t)
	ctx := context.Background()
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))

	var wg sync.WaitGroup
	applied := make([][]string, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			applied[i], errs[i] = schema.Migrate(ctx, db.Pool, logger)
		}()
	}
	wg.Wait()
	total := 0
	for i := range 4 {
		if errs[i] != nil {
			t.Fatalf("concurrent migrate %d: %v", i, errs[i])
		}
		total += len(applied[i])
	}
	files, _ := schemaFiles()
	if total != len(files) {
		t.Errorf("concurrent migrations applied %d migrations in all, want each of the %d once", total, len(files))
	}
	again, err := schema.Migrate(ctx, db.Pool, logger)
	if err != nil || len(again) != 0 {
		t.Errorf("second migrate: applied %v, err %v; want nothing", again, err)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil {
		t.Errorf("outbox table: %v", err)
	}
}

func schemaFiles() ([]string, error) {
	var b bytes.Buffer
	if err := schema.Print(&b); err != nil {
		return nil, err
	}
	var files []string
	for line := range strings.Lines(b.String()) {
		if name, ok := strings.CutPrefix(line, "-- fanout migration "); ok {
			files = append(files, strings.TrimSpace(name))
		}
	}
	return files, nil
}

// The printed SQL, applied by another tool, builds the same schema.
func TestPrintedSQLBuildsTheSchema(t *testing.T) {
	t.Parallel()
	db := emptyDB(t)
	var b bytes.Buffer
	if err := schema.Print(&b); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(b.String(), "+goose") || strings.Contains(b.String(), "DROP TABLE processed_events") || strings.Contains(b.String(), "DROP FUNCTION fanout_outbox_last_id") {
		t.Fatalf("printed SQL carries goose annotations or down migrations:\n%s", b.String())
	}
	ctx := context.Background()
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Conn().PgConn().Exec(ctx, b.String()).ReadAll(); err != nil {
		t.Fatalf("apply printed SQL: %v", err)
	}
	for _, table := range []string{"outbox", "processed_events", "brands", "categories", "products", "inventory", "orders", "order_lines", "invoices", "invoice_lines"} {
		var exists bool
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil || !exists {
			t.Errorf("table %s missing after applying the printed SQL", table)
		}
	}
}
