package outboxstore_test

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The outbox's ranges (schema migration 00008), step by step on a database
// of their own: added ahead of the ids, sealed once full, and dropped only
// when every row in them was published longer than the retention ago; a
// failed row outlives its range in outbox_default.
func TestOutboxRanges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	ranges := func() []outboxstore.Partition {
		t.Helper()
		ps, err := store.Partitions(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return ps
	}
	retire := func(name string, r outboxstore.Retirement) (bool, int64, string) {
		t.Helper()
		ok, moved, reason, err := store.RetirePartition(ctx, name, r)
		if err != nil {
			t.Fatalf("retire %s: %v", name, err)
		}
		return ok, moved, reason
	}
	partitionOf := func(id int64) string {
		t.Helper()
		var name string
		if err := db.Pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM outbox WHERE id = $1`, id).Scan(&name); err != nil {
			t.Fatalf("row %d: %v", id, err)
		}
		return name
	}

	// A wal relay's slot, made before the rows (the wal part below): the
	// retirement reads its confirmed position, whatever it is told.
	slot := "ranges_" + db.Name
	exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
	t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, slot) })

	// Rows written before any range exists go to outbox_default; the
	// first range starts the margin above the next id.
	early := writeOrders(t, db.Pool, 3, "1")
	added, err := store.ExtendPartitions(ctx, 10, 2, 5)
	if err != nil || len(added) != 2 || added[0] != "outbox_9" || added[1] != "outbox_19" {
		t.Fatalf("extend from id 4 by 2 ranges of 10, margin 5: %v (%v); want outbox_9 and outbox_19", added, err)
	}
	if again, err := store.ExtendPartitions(ctx, 10, 2, 5); err != nil || len(again) != 0 {
		t.Fatalf("extend again with the ranges ahead: %v (%v); want nothing", again, err)
	}
	if got := partitionOf(early[0]); got != "outbox_default" {
		t.Fatalf("a row written before any range is in %s", got)
	}

	ids := writeOrders(t, db.Pool, 25, "1") // ids 4..28: 4..8 in outbox_default, 9..18, 19..28
	if got := partitionOf(ids[len(ids)-1]); got != "outbox_19" {
		t.Fatalf("row %d is in %s, want outbox_19", ids[len(ids)-1], got)
	}
	// Only a range whose ids were all handed out seals.
	for _, p := range ranges() {
		sealed, err := store.SealPartition(ctx, p.Name)
		if err != nil || !sealed {
			t.Fatalf("seal the full range %s: %t (%v)", p.Name, sealed, err)
		}
	}
	// The ids reached the last range's end: the next starts the margin
	// above them.
	if added, err := store.ExtendPartitions(ctx, 10, 2, 5); err != nil || len(added) != 2 || added[0] != "outbox_34" {
		t.Fatalf("extend past id 28: %v (%v); want outbox_34 and outbox_44", added, err)
	}
	if sealed, err := store.SealPartition(ctx, "outbox_34"); err != nil || sealed {
		t.Fatalf("seal the empty range outbox_34: %t (%v); want not sealed", sealed, err)
	}
	poll := outboxstore.Retirement{BacklogThrough: math.MinInt64}
	if ok, _, reason := retire("outbox_34", poll); ok || reason != "not sealed" {
		t.Fatalf("retire an unsealed range: %t %q", ok, reason)
	}

	// Poll capture: unsent rows keep their range; so do rows sent within
	// retention; a failed row moves to outbox_default.
	if ok, _, reason := retire("outbox_9", poll); ok || reason != "10 rows not yet published" {
		t.Fatalf("retire a range of pending rows: %t %q", ok, reason)
	}
	exec(`UPDATE outbox SET status = 'sent', published_at = now() WHERE id BETWEEN 9 AND 18`)
	exec(`UPDATE outbox SET status = 'failed', published_at = NULL, last_error = 'poison' WHERE id = 12`)
	poll.Retention = time.Hour
	if ok, _, reason := retire("outbox_9", poll); ok || reason != "within retention" {
		t.Fatalf("retire a range sealed just now, retention 1h: %t %q", ok, reason)
	}
	poll.Retention = time.Second
	time.Sleep(1100 * time.Millisecond)
	exec(`UPDATE outbox SET published_at = now() WHERE id = 18`) // sent again (republish) just now
	if ok, _, reason := retire("outbox_9", poll); ok || reason != "rows published within retention" {
		t.Fatalf("retire a range with a row published just now: %t %q", ok, reason)
	}
	exec(`UPDATE outbox SET published_at = now() - interval '1 minute' WHERE id = 18`)
	if ok, _, reason := retire("outbox_9", poll); ok || reason != "within retention" {
		t.Fatalf("retire right after the range was last found published: %t %q; want within retention (done_at)", ok, reason)
	}
	exec(`UPDATE outbox_partitions SET done_at = now() - interval '1 minute' WHERE name = 'outbox_9'`)
	if ok, moved, reason := retire("outbox_9", poll); !ok || moved != 1 {
		t.Fatalf("retire a published range: %t, moved %d, %q; want dropped, its failed row moved", ok, moved, reason)
	}
	if got := partitionOf(12); got != "outbox_default" {
		t.Fatalf("the failed row is in %s, want outbox_default", got)
	}
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE id BETWEEN 9 AND 18`).Scan(&left); err != nil || left != 1 {
		t.Fatalf("rows of the dropped range left: %d (%v); want the failed one", left, err)
	}

	// Wal capture: the rows stay pending; a range goes once the slot
	// confirmed past its seal, retention after that, and not while a row
	// in it waits for the backlog's claim, was returned to the relays, or
	// has no landing. What the caller says of the slot is not taken: the
	// function reads the slot and the backlog bound itself (the relay's
	// role told it the slot had confirmed everything and there was no
	// backlog, and a range of rows never published was dropped).
	var sealedLSN string
	if err := db.Pool.QueryRow(ctx, `SELECT sealed_lsn::text FROM outbox_partitions WHERE name = 'outbox_19'`).Scan(&sealedLSN); err != nil {
		t.Fatal(err)
	}
	wal := outboxstore.Retirement{Retention: time.Second, Captured: true, ConfirmedLSN: "FFFFFFFF/FFFFFFFF", BacklogThrough: math.MinInt64}
	// No wal relay recorded a slot: every pending row is unpublished.
	if ok, _, reason := retire("outbox_19", wal); ok || reason != "10 rows not yet published" {
		t.Fatalf("retire told of a slot no relay recorded: %t %q, want its 10 pending rows unpublished", ok, reason)
	}
	exec(`INSERT INTO relay_capture (slot_name, backlog_through) VALUES ($1, 20)`, slot)
	if ok, _, reason := retire("outbox_19", wal); ok || reason != "the slot has not confirmed its rows" {
		t.Fatalf("retire before the slot confirmed, told it confirmed everything: %t %q", ok, reason)
	}
	exec(`SELECT pg_replication_slot_advance($1, $2::pg_lsn)`, slot, sealedLSN)
	if ok, _, reason := retire("outbox_19", wal); ok || reason != "the slot has just confirmed its rows" {
		t.Fatalf("retire as the slot confirms: %t %q", ok, reason)
	}
	exec(`UPDATE outbox_partitions SET done_at = now() - interval '1 minute' WHERE name = 'outbox_19'`)
	if ok, _, reason := retire("outbox_19", wal); ok || reason != "10 rows not yet published" {
		t.Fatalf("retire with rows 19 and 20 in the backlog and none landed, told there is no backlog: %t %q", ok, reason)
	}
	// Where the slot's rows landed, but for row 26.
	exec(`INSERT INTO outbox_landings (stream, first_id, last_id, event_ids, seqs) VALUES
	      ('EVENTS', 21, 25, '{21,22,23,24,25}', '{1,2,3,4,5}'), ('EVENTS', 27, 28, '{27,28}', '{7,8}')`)
	if ok, _, reason := retire("outbox_19", wal); ok || reason != "3 rows not yet published" {
		t.Fatalf("retire with rows 19 and 20 in the backlog and row 26 not landed: %t %q", ok, reason)
	}
	exec(`UPDATE relay_capture SET backlog_done_at = now()`)
	exec(`INSERT INTO outbox_landings (stream, first_id, last_id, event_ids, seqs) VALUES ('EVENTS', 19, 26, '{19,20,26}', '{9,10,6}')`)
	exec(`UPDATE outbox SET available_at = now() WHERE id = 25`) // returned by an operator
	if ok, _, reason := retire("outbox_19", wal); ok || reason != "rows published within retention" {
		t.Fatalf("retire with a row returned just now: %t %q", ok, reason)
	}
	exec(`UPDATE outbox SET available_at = now() - interval '1 minute' WHERE id = 25`)
	exec(`UPDATE outbox_partitions SET done_at = now() - interval '1 minute' WHERE name = 'outbox_19'`)
	if ok, moved, reason := retire("outbox_19", wal); !ok || moved != 0 {
		t.Fatalf("retire a captured range: %t, moved %d, %q", ok, moved, reason)
	}
	var names []string
	for _, p := range ranges() {
		names = append(names, p.Name)
	}
	if len(names) != 2 || names[0] != "outbox_34" || names[1] != "outbox_44" {
		t.Fatalf("ranges left: %v, want outbox_34 and outbox_44", names)
	}
	if ok, _, reason := retire("outbox_19", wal); ok || reason != "no such range" {
		t.Fatalf("retire a dropped range: %t %q", ok, reason)
	}
}

// Writers never fail while ranges are added under them, even when their ids
// have outrun the ranges and their rows go to outbox_default: a range
// attached while a writer's row is on its way to outbox_default starts
// above the writer's id (reproduced before the margin: "new row for
// relation outbox_default violates partition constraint").
func TestWritersSurviveRangesAddedUnderThem(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	db := pgtest.NewDB(t)
	store := outboxstore.New(db.Pool)
	stop := make(chan struct{})
	errs := make(chan error, 4)
	for w := range 4 {
		go func() {
			for {
				select {
				case <-stop:
					errs <- nil
					return
				default:
				}
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					_, err := outbox.Write(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: "w", Type: "order.created",
						Payload: json.RawMessage(`{"writer": ` + string(rune('0'+w)) + `}`)})
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	// Ranges of 20 ids, one ahead, so that the writers keep catching up.
	// The first range starts the margin (1000 ids) above the writers, so the
	// loop runs until they have written well into the ranges, however slow
	// the host: a fixed time proved too short under -race on a busy one.
	counts := func() (inRanges, inDefault int) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE tableoid <> 'outbox_default'::regclass),
		                                        count(*) FILTER (WHERE tableoid = 'outbox_default'::regclass) FROM outbox`).Scan(&inRanges, &inDefault); err != nil {
			t.Fatal(err)
		}
		return inRanges, inDefault
	}
	const wantInRanges = 400 // 20 ranges' worth, each attached while writers were at it
	added, lockTimeouts := 0, 0
	for {
		names, err := store.ExtendPartitions(ctx, 20, 1, 1000)
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "55P03" {
			// The functions wait at most lock_timeout (200 ms) for their
			// locks, and the relay tries again at its next pass: so does
			// this loop (a busy host under -race gets there).
			lockTimeouts++
			continue
		}
		if err != nil {
			t.Fatalf("extend: %v", err)
		}
		added += len(names)
		select {
		case err := <-errs: // a writer stops early only on an error
			t.Fatalf("a writer failed while ranges were added: %v", err)
		default:
		}
		if inRanges, _ := counts(); inRanges >= wantInRanges {
			break
		}
		if ctx.Err() != nil {
			inRanges, inDefault := counts()
			t.Fatalf("%d ranges added, %d rows in them and %d in outbox_default at the test's deadline: the writers did not reach the ranges", added, inRanges, inDefault)
		}
	}
	close(stop)
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatalf("a writer failed while ranges were added: %v", err)
		}
	}
	inRanges, inDefault := counts()
	t.Logf("%d ranges added (%d attempts gave up on a lock); %d rows in ranges, %d in outbox_default", added, lockTimeouts, inRanges, inDefault)
}
