package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/searchindex"
)

// Every reindex subcommand as an operator runs it, one after the other,
// and none of the changing ones while another holds the alias's lock.
func TestReindexCommands(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	sc := searchtest.Client(t, search.OpenSearch)
	alias := searchtest.Alias(t, sc)
	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + nats.URL,
		"FANOUT_SEARCH_ENGINE=opensearch", "FANOUT_SEARCH_URL=" + searchtest.URL(), "FANOUT_SEARCH_ALIAS=" + alias,
		"FANOUT_LOG_FORMAT=json",
	}
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 30, rand.New(rand.NewPCG(3, 3))); err != nil {
		t.Fatal(err)
	}
	mustRun := func(want string, args ...string) string {
		t.Helper()
		out, err := run(t, env, args...)
		if err != nil || !strings.Contains(out, want) {
			t.Fatalf("fanout %s: %v\n%s\nwant %q in the output", strings.Join(args, " "), err, out, want)
		}
		return out
	}
	v1, v2 := searchindex.IndexName(alias, 1), searchindex.IndexName(alias, 2)
	// A first reindex on an installation with no stream yet: nothing to replay.
	mustRun("reindexed 30 of 30 products into "+v1, "reindex")
	mustRun("no drift", "reindex", "--check")

	// While another command holds the lock, the changing commands refuse
	// and say why; a plain --check still reads.
	unlock, err := searchindex.Lock(ctx, db.Pool, alias)
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"reindex"}, {"reindex", "rollback"}, {"reindex", "cleanup"}, {"reindex", "--check", "--repair"}} {
		out, err := run(t, env, args...)
		if err == nil || !strings.Contains(out, "another fanout reindex") || !strings.Contains(out, alias) {
			t.Errorf("fanout %s while the lock is held: %v\n%s\nwant a refusal naming the alias", strings.Join(args, " "), err, out)
		}
	}
	mustRun("no drift", "reindex", "--check")
	unlock()

	mustRun("reindexed 30 of 30 products into "+v2, "reindex")
	mustRun("alias "+alias+" now points at "+v1+" (was "+v2+")", "reindex", "rollback")
	out := mustRun("deleted", "reindex", "cleanup")
	if !regexp.MustCompile(`deleted \[` + regexp.QuoteMeta(v2) + `\]`).MatchString(out) {
		t.Errorf("cleanup: %s; want %s deleted", out, v2)
	}
	if versions, err := searchindex.Versions(ctx, sc, alias); err != nil || len(versions) != 1 || versions[0] != v1 {
		t.Errorf("indices after the cleanup: %v (%v), want only %s", versions, err, v1)
	}
}

// A document that differs from SQL at the version SQL has (written behind
// fanout's back) is repaired by `reindex rollback` and by `reindex --check
// --repair`, which say how many documents they fixed; one whose version is
// above SQL's cannot be, and the repair names it, says why and fails.
func TestReindexRepairsDriftAtTheSameVersion(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	sc := searchtest.Client(t, search.OpenSearch)
	alias := searchtest.Alias(t, sc)
	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + nats.URL,
		"FANOUT_SEARCH_ENGINE=opensearch", "FANOUT_SEARCH_URL=" + searchtest.URL(), "FANOUT_SEARCH_ALIAS=" + alias,
		"FANOUT_LOG_FORMAT=json",
	}
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 20, rand.New(rand.NewPCG(4, 4))); err != nil {
		t.Fatal(err)
	}
	var same, above int64
	if err := db.Pool.QueryRow(ctx, `SELECT min(id), max(id) FROM products`).Scan(&same, &above); err != nil {
		t.Fatal(err)
	}
	products, err := shop.LoadProducts(ctx, db.Pool, []int64{same, above})
	if err != nil {
		t.Fatal(err)
	}
	corrupt := func(index string, id, version int64, versionType string) {
		p := products[id]
		p.Name = "CORRUPTED"
		searchtest.Put(t, index, strconv.FormatInt(id, 10), version, versionType, p)
	}
	mustRun := func(want string, args ...string) string {
		t.Helper()
		out, err := run(t, env, args...)
		if err != nil || !strings.Contains(out, want) {
			t.Fatalf("fanout %s: %v\n%s\nwant %q in the output", strings.Join(args, " "), err, out, want)
		}
		return out
	}
	v1, v2 := searchindex.IndexName(alias, 1), searchindex.IndexName(alias, 2)
	mustRun("into "+v1, "reindex")
	mustRun("into "+v2, "reindex")

	// The old index drifts at SQL's version; the rollback to it repairs it.
	corrupt(v1, same, products[same].Version, search.ExternalGTE)
	out := mustRun("alias "+alias+" now points at "+v1+" (was "+v2+"); 1 documents it had missed", "reindex", "rollback")
	if !strings.Contains(out, "repaired 1 of 1 drifted documents") {
		t.Errorf("rollback output:\n%s\nwant the repaired document counted", out)
	}
	mustRun("no drift", "reindex", "--check")

	// The same drift again, and a document above SQL's version.
	corrupt(v1, same, products[same].Version, search.ExternalGTE)
	corrupt(v1, above, products[above].Version+100, search.External)
	out, err = run(t, env, "reindex", "--check")
	if err == nil || !strings.Contains(out, fmt.Sprintf("2 different (%d, %d)", same, above)) {
		t.Fatalf("fanout reindex --check: %v\n%s\nwant both documents reported", err, out)
	}
	out, err = run(t, env, "reindex", "--check", "--repair")
	reason := fmt.Sprintf("document %d: the index holds version %d, above SQL's %d", above, products[above].Version+100, products[above].Version)
	if err == nil || !strings.Contains(out, "repaired 1 of 2 drifted documents") || !strings.Contains(out, "could not repair 1 documents") ||
		!strings.Contains(out, reason) || !strings.Contains(out, "1 of 2 drifted documents could not be repaired") {
		t.Fatalf("fanout reindex --check --repair: %v\n%s\nwant 1 repaired, %q named, and a failure", err, out, reason)
	}
	t.Logf("fanout reindex --check --repair:\n%s", out)
	out, err = run(t, env, "reindex", "--check")
	if err == nil || !strings.Contains(out, fmt.Sprintf("1 different (%d)", above)) {
		t.Errorf("fanout reindex --check after the repair: %v\n%s\nwant only %d left", err, out, above)
	}
}
