package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/fanout/fanout/internal/pgtest"
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
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
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
			}
		}
	}
}

// scan is how a plan reads one relation.
type scan struct{ node, index, cond string }

// probeScans returns how each scan of a relation aliased alias (or
// alias_N, one of its ranges) in an EXPLAIN (FORMAT JSON) plan reads it.
func probeScans(t *testing.T, plan []byte, alias string) []scan {
	t.Helper()
	type node struct {
		NodeType  string `json:"Node Type"`
		Alias     string `json:"Alias"`
		IndexName string `json:"Index Name"`
		IndexCond string `json:"Index Cond"`
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
			scans = append(scans, scan{n.NodeType, n.IndexName, n.IndexCond})
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(doc[0].Plan)
	return scans
}
