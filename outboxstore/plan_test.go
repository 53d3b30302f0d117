package outboxstore

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/fanout/fanout/schema/pgtest"
)

// The relay's claims probe the aggregates' own entries of
// outbox_aggregate_unsent_idx, one aggregate at a time, never the whole of
// it nor outbox_unsent_idx, in the state that tempts the planner most:
// statistics taken when every row was published (as they usually are),
// which make both partial indexes look empty. Under a held snapshot both
// hold every row published since, and a claim that scanned one read tens
// of thousands of pages (see migration 00013). The plan for the claim's
// own arguments and the generic plan a prepared statement falls back to
// are both checked.
func TestClaimsProbeOnlyTheAggregatesEntries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	exec := execer(t, db)
	write := func(n int) {
		exec(`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', (i % 20)::text, 'order.paid', '{}' FROM generate_series(1, $1) i`, n)
	}
	write(2000)
	exec(`UPDATE outbox SET status = 'sent', published_at = now()`)
	exec(`VACUUM ANALYZE outbox_default`)
	write(40)

	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var floor int64
	if err := conn.QueryRow(ctx, `SELECT max(id) - 100 FROM outbox`).Scan(&floor); err != nil {
		t.Fatal(err)
	}
	// EXECUTE takes no bind parameters: the arguments are literals.
	const token = `'00000000-0000-0000-0000-000000000001'`
	statements := []struct{ name, params, sql, args string }{
		{"claim", "int, uuid, bigint, bigint, boolean, int", claimWindowSQL,
			fmt.Sprintf("500, %s, %d, %d, true, 99", token, int64(math.MaxInt64), floor)},
		{"next", "text[], text[], bigint[], uuid, int, int", claimNextSQL,
			fmt.Sprintf("'{order,order}', '{3,4}', '{90,90}', %s, 8, 100", token)},
		{"heads", "int, uuid, boolean, text, text, int", claimHeadsSQL,
			fmt.Sprintf("500, %s, true, '', '', 100", token)},
	}
	for _, st := range statements {
		if _, err := conn.Exec(ctx, fmt.Sprintf(`PREPARE %s(%s) AS %s`, st.name, st.params, st.sql)); err != nil {
			t.Fatalf("prepare %s: %v", st.name, err)
		}
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			if _, err := conn.Exec(ctx, `SET plan_cache_mode = `+mode); err != nil {
				t.Fatal(err)
			}
			var plan []byte
			if err := conn.QueryRow(ctx, fmt.Sprintf(`EXPLAIN (FORMAT JSON) EXECUTE %s(%s)`, st.name, st.args)).Scan(&plan); err != nil {
				t.Fatalf("explain %s: %v", st.name, err)
			}
			probes := probeScans(t, plan, "e")
			if len(probes) == 0 {
				t.Fatalf("%s, %s: no scan of the probe's alias e in the plan:\n%s", st.name, mode, plan)
			}
			for _, p := range probes {
				if !strings.Contains(p.index, "aggregate") || !strings.Contains(p.cond, "aggregate_type") {
					t.Errorf("%s, %s: the probe is a %s of %q (index condition %q), want a probe of outbox_aggregate_unsent_idx by aggregate; plan:\n%s",
						st.name, mode, p.node, p.index, p.cond, plan)
				}
				// The claim's probe looks up the one event before the row,
				// not a range of its aggregate's numbers (headOfAggregate).
				if st.name == "claim" && !strings.Contains(p.cond, "(aggregate_seq = (o.aggregate_seq - 1))") {
					t.Errorf("%s, %s: the probe's index condition is %q, want the number before the row's alone", st.name, mode, p.cond)
				}
			}
		}
	}
}

// scan is how a plan reads one relation, and the buffers it read (with
// EXPLAIN's ANALYZE and BUFFERS).
type scan struct {
	node, index, cond string
	buffers           int64
}

// probeScans returns how each scan of a relation aliased alias (or
// alias_N, one of its ranges) in an EXPLAIN (FORMAT JSON) plan reads it.
func probeScans(t *testing.T, plan []byte, alias string) []scan {
	t.Helper()
	type node struct {
		NodeType  string `json:"Node Type"`
		Alias     string `json:"Alias"`
		IndexName string `json:"Index Name"`
		IndexCond string `json:"Index Cond"`
		Hit       int64  `json:"Shared Hit Blocks"`
		Read      int64  `json:"Shared Read Blocks"`
		Plans     []node `json:"Plans"`
	}
	var doc []struct {
		Plan node `json:"Plan"`
	}
	if err := json.Unmarshal(plan, &doc); err != nil || len(doc) != 1 {
		t.Fatalf("read the plan: %v", err)
	}
	var scans []scan
	var walk func(n node)
	walk = func(n node) {
		if n.Alias == alias || strings.HasPrefix(n.Alias, alias+"_") {
			scans = append(scans, scan{n.NodeType, n.IndexName, n.IndexCond, n.Hit + n.Read})
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(doc[0].Plan)
	return scans
}

// While a snapshot is held, every event of an aggregate published since
// keeps its entry in outbox_aggregate_unsent_idx. The claim's probe of a
// row's aggregate reads the entry of the event before it only, so its cost
// does not grow with the aggregate's history: here 400 published events
// behind a held snapshot, which a probe of every earlier number steps over
// one by one (403 buffers, when tried with such a probe).
func TestClaimProbeUnderHeldSnapshotReadsOneEntry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	exec := execer(t, db)
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ`); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT count(*) FROM outbox`); err != nil {
		t.Fatal(err)
	}
	// 400 events of each of 40 orders, interleaved: one order's events lie
	// on pages of their own, as a busy outbox's do.
	exec(`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', (g % 40)::text, 'order.paid', '{}' FROM generate_series(1, 16000) g`)
	exec(`UPDATE outbox SET status = 'sent', published_at = now()`)
	exec(`VACUUM outbox_default`) // removes nothing the held snapshot may see
	exec(`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '7', 'order.shipped', '{}')`)

	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `PREPARE claim(int, uuid, bigint, bigint, boolean, int) AS `+claimWindowSQL); err != nil {
		t.Fatal(err)
	}
	var plan []byte
	if err := conn.QueryRow(ctx, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim(10, '00000000-0000-0000-0000-000000000001', 9223372036854775807, 0, true, 100)`).Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var seq int64
	var status string
	if err := db.Pool.QueryRow(ctx, `SELECT aggregate_seq, status FROM outbox WHERE event_type = 'order.shipped'`).Scan(&seq, &status); err != nil {
		t.Fatal(err)
	}
	if seq != 401 || status != "sending" {
		t.Fatalf("the event after 400 published ones: number %d, %s; want 401, claimed (sending)", seq, status)
	}
	var buffers int64
	for _, p := range probeScans(t, plan, "e") {
		buffers += p.buffers
	}
	if buffers < 1 || buffers > 20 {
		t.Errorf("the probe read %d buffers, want a handful (one entry and its row); plan:\n%s", buffers, plan)
	}
}

// execer returns a function that runs a statement on db, or fails t.
func execer(t *testing.T, db *pgtest.DB) func(sql string, args ...any) {
	return func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(context.Background(), sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
}
