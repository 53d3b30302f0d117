package main

import (
	"context"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"

	"github.com/fanout/fanout/internal/natstest"
	"github.com/fanout/fanout/internal/pgtest"
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
