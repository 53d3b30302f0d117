package schema_test

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/fanout/fanout/schema"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
)

// An installation from before the outbox was partitioned keeps its rows
// and its ids: migration 00008 makes the old table the first range, the
// identity goes on from where it was, and the publication decodes the
// partitioned table as outbox.
func TestPartitioningKeepsAnExistingOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := emptyDB(t)
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer sqlDB.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, schema.Migrations(),
		goose.WithTableName("fanout_schema_version"), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := provider.UpTo(ctx, 7); err != nil {
		t.Fatalf("migrate up to 00007: %v", err)
	}
	if _, err := db.Pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at)
SELECT 'order', g::text, 'order.created', '{}', CASE WHEN g <= 3 THEN 'sent' ELSE 'pending' END,
       CASE WHEN g <= 3 THEN now() END
FROM generate_series(1, 5) g`); err != nil {
		t.Fatal(err)
	}
	applied, err := schema.Migrate(ctx, db.Pool, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil || len(applied) == 0 {
		t.Fatalf("migrate the rest: %v (%v)", applied, err)
	}

	var legacy, sent int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE tableoid = 'outbox_legacy'::regclass),
	                                        count(*) FILTER (WHERE status = 'sent') FROM outbox`).Scan(&legacy, &sent); err != nil || legacy != 5 || sent != 3 {
		t.Fatalf("after the migration: %d rows in outbox_legacy, %d sent (%v); want all 5, 3 sent", legacy, sent, err)
	}
	var upper int64
	if err := db.Pool.QueryRow(ctx, `SELECT upper_id FROM outbox_partitions WHERE name = 'outbox_legacy' AND lower_id IS NULL`).Scan(&upper); err != nil || upper != 6 {
		t.Fatalf("outbox_legacy's range: up to %d (%v), want 6", upper, err)
	}
	var id int64
	var where string
	if err := db.Pool.QueryRow(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '6', 'order.created', '{}')
RETURNING id, tableoid::regclass::text`).Scan(&id, &where); err != nil || id != 6 || where != "outbox_default" {
		t.Fatalf("the next row: id %d in %s (%v), want 6 in outbox_default", id, where, err)
	}
	var viaRoot bool
	var tables string
	if err := db.Pool.QueryRow(ctx, `
SELECT p.pubviaroot, (SELECT string_agg(tablename, ',') FROM pg_publication_tables WHERE pubname = p.pubname)
FROM pg_publication p WHERE p.pubname = 'fanout_outbox'`).Scan(&viaRoot, &tables); err != nil || !viaRoot || tables != "outbox" {
		t.Fatalf("publication: via root %t, tables %q (%v); want via root, outbox", viaRoot, tables, err)
	}
}
