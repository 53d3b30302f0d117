package search_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// index creates an index of the test's own and deletes it at the end.
func index(t *testing.T, c *search.Client) string {
	t.Helper()
	name := fmt.Sprintf("t%08x-bulk", rand.Uint32())
	ctx := context.Background()
	if err := c.CreateIndex(ctx, name, []byte(`{"settings": {"number_of_shards": 1, "number_of_replicas": 0}}`)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.DeleteIndex(context.Background(), name) })
	return name
}

func bulk(t *testing.T, c *search.Client, index string, op search.Op) search.Result {
	t.Helper()
	res, err := c.Bulk(context.Background(), index, []search.Op{op})
	if err != nil {
		t.Fatal(err)
	}
	return res[0]
}

func source(t *testing.T, c *search.Client, index, id string) (string, int64) {
	t.Helper()
	docs, err := c.MGet(context.Background(), index, []string{id})
	if err != nil {
		t.Fatal(err)
	}
	return string(docs[id].Source), docs[id].Version
}

// What each bulk item answer means, as the engine gives it: a write at the
// stored version is a 409 under external versioning (counted as done) and
// applied under external_gte (a repair); a delete of a missing document is
// a 404 that counts as done.
func TestBulkVersionsAndOutcomes(t *testing.T) {
	t.Parallel()
	for _, engine := range searchtest.Engines {
		t.Run(engine, func(t *testing.T) {
			t.Parallel()
			c := searchtest.Client(t, engine)
			idx := index(t, c)

			if r := bulk(t, c, idx, search.Op{ID: "1", Version: 5, Doc: []byte(`{"v": "five"}`)}); r.Status != http.StatusCreated || !r.OK() {
				t.Fatalf("first write at version 5: %+v", r)
			}
			// Same version, other content: external refuses it, and that
			// counts as done, which is right for racing indexers and wrong
			// for a repair.
			r := bulk(t, c, idx, search.Op{ID: "1", Version: 5, Doc: []byte(`{"v": "other"}`)})
			if r.Status != http.StatusConflict || !r.OK() || r.Type != "version_conflict_engine_exception" {
				t.Errorf("external write at the stored version: %+v, want a 409 that counts as done", r)
			}
			if src, _ := source(t, c, idx, "1"); !strings.Contains(src, "five") {
				t.Errorf("document after the refused write: %s", src)
			}
			// external_gte applies it, and still refuses an older version.
			if r := bulk(t, c, idx, search.Op{ID: "1", Version: 5, VersionType: search.ExternalGTE, Doc: []byte(`{"v": "fixed"}`)}); r.Status != http.StatusOK {
				t.Errorf("external_gte write at the stored version: %+v, want 200", r)
			}
			if src, v := source(t, c, idx, "1"); !strings.Contains(src, "fixed") || v != 5 {
				t.Errorf("document after the external_gte write: %s at version %d, want fixed at 5", src, v)
			}
			if r := bulk(t, c, idx, search.Op{ID: "1", Version: 4, VersionType: search.ExternalGTE, Doc: []byte(`{"v": "old"}`)}); r.Status != http.StatusConflict {
				t.Errorf("external_gte write below the stored version: %+v, want 409", r)
			}
			// A delete of a document that is not there: done.
			r = bulk(t, c, idx, search.Op{ID: "404", Delete: true, Version: 9})
			if r.Status != http.StatusNotFound || !r.OK() || !r.AlreadyDeleted() || r.Result != "not_found" {
				t.Errorf("delete of a missing document: %+v, want a 404 not_found that counts as done", r)
			}
			if _, err := c.Bulk(context.Background(), idx, []search.Op{{ID: "1", Version: 1, VersionType: "force"}}); err == nil {
				t.Error("bulk with an unknown version type: no error")
			}
		})
	}
}

// A write into an index that does not exist, where the engine may not
// create it (the index behind the alias is gone and auto-creation is
// off), is a 404 index_not_found_exception for an index operation and a
// delete alike: a failure, not a success and not an overload. Only a
// delete's not_found is done.
func TestBulkIntoAMissingIndexFails(t *testing.T) {
	t.Parallel()
	for _, engine := range searchtest.Engines {
		t.Run(engine, func(t *testing.T) {
			c := searchtest.Client(t, engine)
			gone := fmt.Sprintf("t%08x-gone", rand.Uint32())
			searchtest.ForbidAutoCreate(t, gone+"*")
			t.Cleanup(func() { _ = c.DeleteIndex(context.Background(), gone) }) // if the engine created it after all
			res, err := c.Bulk(context.Background(), gone, []search.Op{
				{ID: "1", Version: 3, Doc: []byte(`{"v": 1}`)},
				{ID: "2", Delete: true, Version: 3},
			})
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range res {
				if r.Status != http.StatusNotFound || r.Type != "index_not_found_exception" || r.OK() || r.Retryable() || r.AlreadyDeleted() {
					t.Errorf("write into a missing index: %+v; want a 404 index_not_found_exception that is neither OK nor retryable", r)
				}
			}
			if names, _ := c.Indices(context.Background(), gone); len(names) != 0 {
				t.Errorf("the engine created %v: the test proves nothing", names)
			}
		})
	}
}
