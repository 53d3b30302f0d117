package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

var retentionRows = flag.Int64("retention-rows", relay.DefaultPartitionSize, "rows of the range the retention part removes")

// retentionCost is what removing one range of published rows cost the
// database.
type retentionCost struct {
	took     time.Duration // the removal, and the vacuum it leaves behind
	walBytes int64         // WAL the removal and the vacuum wrote
	dead     int64         // dead rows the removal left for vacuum
}

// benchRetention measures what retention costs the database for one range
// of captured rows (wal capture leaves them pending): deleting them in
// batches of relay.cleanup_batch, as the relays did before migration 00008,
// and then vacuuming the dead rows away, against dropping their range.
func benchRetention(ctx context.Context, _ *nats.Conn) error {
	var delTook, delWAL, delDead, dropTook, dropWAL benchkit.Figure
	for range *benchkit.Runs {
		del, err := retentionRun(ctx, false)
		if err != nil {
			return fmt.Errorf("delete row by row: %w", err)
		}
		drop, err := retentionRun(ctx, true)
		if err != nil {
			return fmt.Errorf("drop the range: %w", err)
		}
		delTook.Add(del.took.Seconds() * 1000)
		delWAL.Add(float64(del.walBytes) / (1 << 20))
		delDead.Add(float64(del.dead))
		dropTook.Add(drop.took.Seconds() * 1000)
		dropWAL.Add(float64(drop.walBytes) / (1 << 20))
	}
	fmt.Printf("retention: removing one range of %d captured rows (after a checkpoint), %d runs\n", *retentionRows, *benchkit.Runs)
	fmt.Printf("    row by row (DELETE in batches of %d, then VACUUM): %s, WAL %s, dead rows left for vacuum %s\n",
		relay.DefaultConfig().CleanupBatch, delTook.Format("%.0fms"), delWAL.Format("%.1f MiB"), delDead.Format("%.0f"))
	fmt.Printf("    dropping the range (fanout_outbox_retire):          %s, WAL %s, dead rows 0\n\n",
		dropTook.Format("%.0fms"), dropWAL.Format("%.2f MiB"))
	return nil
}

// retentionRun fills one range of -retention-rows captured rows in a
// fresh database and removes them: by dropping the range, or row by row.
func retentionRun(ctx context.Context, dropRange bool) (c retentionCost, err error) {
	db, err := pgtest.Create(ctx, *benchkit.AdminURL)
	if err != nil {
		return c, err
	}
	defer db.Close()
	store := outboxstore.New(db.Pool)
	slot := ""
	if dropRange {
		// The retirement reads the slot's confirmed position and the
		// rows' landings from the database, as a wal relay leaves them.
		slot = "bench_retention_" + db.Name
		if _, err := db.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot); err != nil {
			return c, fmt.Errorf("make a slot (wal_level logical): %w", err)
		}
		defer db.Pool.Exec(context.WithoutCancel(ctx), `SELECT pg_drop_replication_slot($1)`, slot) //nolint:errcheck // before the database goes
	}
	name, err := fillRange(ctx, db.Pool, store, slot)
	if err != nil {
		return c, err
	}
	var startLSN string
	if err := db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&startLSN); err != nil {
		return c, err
	}
	start := time.Now()
	if dropRange {
		err = retireRange(ctx, store, name, startLSN)
	} else {
		c.dead, err = deleteRowByRow(ctx, db.Pool)
	}
	if err != nil {
		return c, err
	}
	c.took = time.Since(start)
	if err := db.Pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint`, startLSN).Scan(&c.walBytes); err != nil {
		return c, err
	}
	var left int64
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE id > 1`).Scan(&left); err != nil || left != 0 {
		return c, fmt.Errorf("%d rows left after the removal (%v)", left, err)
	}
	return c, nil
}

// fillRange adds one range of -retention-rows rows, fills and seals it,
// then vacuums and checkpoints, and returns the range's name. With a slot,
// it records what a wal relay would have by then: the slot as its
// capture's, the rows' landings in the stream, the slot confirmed past
// the range.
func fillRange(ctx context.Context, pool *pgxpool.Pool, store *outboxstore.Store, slot string) (string, error) {
	n := *retentionRows
	// One range from id 2 (a margin of 1: nothing writes meanwhile), and
	// n+1 rows: id 1 in outbox_default, the rest filling the range.
	added, err := store.ExtendPartitions(ctx, n, 1, 1)
	if err != nil || len(added) == 0 {
		return "", fmt.Errorf("add the range: %v (%w)", added, err)
	}
	name := added[0]
	if _, err := pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
SELECT 'product', g::text, 'product.updated',
       jsonb_build_object('product_id', g, 'sku', 'SKU-' || g, 'price_cents', 1999, 'stock', 7, 'name', 'A product of the benchmark'),
       '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'
FROM generate_series(1, $1::bigint) g`, n+1); err != nil {
		return "", fmt.Errorf("write %d rows: %w", n+1, err)
	}
	if sealed, err := store.SealPartition(ctx, name); err != nil || !sealed {
		return "", fmt.Errorf("seal %s: %t (%w)", name, sealed, err)
	}
	if slot != "" {
		if err := recordCapture(ctx, pool, slot, name, n); err != nil {
			return "", fmt.Errorf("record the slot's capture: %w", err)
		}
	}
	for _, sql := range []string{`VACUUM ANALYZE outbox`, `CHECKPOINT`} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			return "", err
		}
	}
	return name, nil
}

// recordCapture records range name's n rows as a wal relay leaves them:
// the slot as its capture's, with no backlog; the rows landed in the
// stream (a landing a thousand ids); the slot confirmed past the range.
func recordCapture(ctx context.Context, pool *pgxpool.Pool, slot, name string, n int64) error {
	if _, err := pool.Exec(ctx, `INSERT INTO relay_capture (slot_name, backlog_through, backlog_done_at) VALUES ($1, 0, now())`, slot); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `INSERT INTO outbox_landings (stream, first_id, last_id, event_ids, seqs)
SELECT 'EVENTS', min(g), max(g), array_agg(g ORDER BY g), array_agg(g ORDER BY g)
FROM generate_series(2, $1::bigint + 1) g GROUP BY (g - 2) / 1000`, n); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `SELECT pg_replication_slot_advance($1, (SELECT sealed_lsn FROM outbox_partitions WHERE name = $2))`, slot, name)
	return err
}

// retireRange drops the range as the relays do (fanout_outbox_retire),
// the slot confirmed at lsn.
func retireRange(ctx context.Context, store *outboxstore.Store, name, lsn string) error {
	r := outboxstore.Retirement{Captured: true, ConfirmedLSN: lsn, BacklogThrough: math.MinInt64}
	for range 2 { // the first notes when the slot confirmed past the range
		ok, _, reason, err := store.RetirePartition(ctx, name, r)
		if err != nil || ok {
			return err
		}
		if reason != "the slot has just confirmed its rows" {
			return fmt.Errorf("range %s kept: %s", name, reason)
		}
	}
	return nil
}

// deleteRowByRow is the relays' delete before migration 00008
// (DeleteCaptured), then the vacuum it calls for; it returns the dead
// rows it left.
func deleteRowByRow(ctx context.Context, pool *pgxpool.Pool) (dead int64, err error) {
	const batch = 1000
	for {
		ct, err := pool.Exec(ctx, `
DELETE FROM outbox
WHERE id IN (
    SELECT id FROM outbox
    WHERE published_at IS NULL AND status = 'pending' AND id > 1
      AND greatest(created_at, available_at) < now()
    ORDER BY id LIMIT $1
    FOR UPDATE SKIP LOCKED)`, batch)
		if err != nil {
			return dead, err
		}
		dead += ct.RowsAffected()
		if ct.RowsAffected() < batch {
			break
		}
	}
	_, err = pool.Exec(ctx, `VACUUM outbox`)
	return dead, err
}
