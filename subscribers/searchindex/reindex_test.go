package searchindex_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/shop/demo"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5/pgxpool"
)

func (f *fixture) reindexer() *searchindex.Reindexer {
	return &searchindex.Reindexer{Client: f.client, Pool: f.env.DB.Pool, JS: f.env.JS, Stream: f.env.Config.Stream,
		Search: f.search, Logger: f.env.Logger, Loaders: 2}
}

// reindexUnderLoad reindexes while the demo writer changes products at
// rate writes/s.
func (f *fixture) reindexUnderLoad(rate int, seed uint64, mix demo.Mix) (searchindex.ReindexReport, error) {
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		d := &demo.Driver{Pool: f.env.DB.Pool, Rate: rate, Rand: rand.New(rand.NewPCG(seed, seed)), Logger: f.env.Logger, Mix: mix}
		_ = d.Run(ctx)
	}()
	time.Sleep(300 * time.Millisecond)
	rep, err := f.reindexer().Reindex(context.Background())
	stop()
	<-done
	return rep, err
}

func (f *fixture) current(t *testing.T) string {
	t.Helper()
	cur, err := searchindex.Current(context.Background(), f.client, f.alias)
	if err != nil {
		t.Fatal(err)
	}
	return cur
}

// A reindex during a steady stream of updates and continuous searches:
// no search fails or comes back empty, and afterwards there is no drift.
func TestReindexDuringUpdatesAndSearches(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 500)
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	if err := f.client.Refresh(context.Background(), f.alias); err != nil {
		t.Fatal(err)
	}

	ctx, stopLoad := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		d := &demo.Driver{Pool: f.env.DB.Pool, Rate: 150, Rand: rand.New(rand.NewPCG(4, 4)), Logger: f.env.Logger,
			Mix: demo.Mix{Price: 40, Stock: 30, Create: 10, Delete: 10, RenameBrand: 5, RenameCategory: 5}}
		_ = d.Run(ctx)
	})
	var searches, failed atomic.Int64
	var firstFailure atomic.Value
	wg.Go(func() {
		for ctx.Err() == nil {
			res, err := f.client.Search(context.Background(), f.alias, map[string]any{"size": 1, "query": map[string]any{"match_all": map[string]any{}}})
			searches.Add(1)
			if err != nil || res.Total == 0 {
				failed.Add(1)
				firstFailure.CompareAndSwap(nil, time.Now().Format("15:04:05.000")+" total "+strconv.FormatInt(res.Total, 10)+", hits "+strconv.Itoa(len(res.Hits))+", error "+errString(err))
			}
			time.Sleep(5 * time.Millisecond)
		}
	})

	time.Sleep(500 * time.Millisecond)
	rep, err := f.reindexer().Reindex(context.Background())
	if err != nil {
		stopLoad()
		wg.Wait()
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // updates keep flowing after the swap
	stopLoad()
	wg.Wait()
	t.Logf("reindex: %+v; %d searches during the test", rep, searches.Load())

	if rep.From != searchindex.IndexName(f.alias, 1) || rep.To != searchindex.IndexName(f.alias, 2) || f.current(t) != rep.To {
		t.Errorf("reindex from %s to %s, alias at %s; want v1 -> v2 and the alias on v2", rep.From, rep.To, f.current(t))
	}
	if n := failed.Load(); n > 0 {
		t.Errorf("%d of %d searches failed or came back empty during the reindex; first: %v", n, searches.Load(), firstFailure.Load())
	}
	// The load runs while products are created and deleted, so the count
	// is the snapshot's, not the seed's.
	if rep.Snapshot < 400 || rep.Loaded != rep.Snapshot || len(rep.Failures) != 0 {
		t.Errorf("loaded %d of the snapshot's %d products with %d failures; want all of them, none failed", rep.Loaded, rep.Snapshot, len(rep.Failures))
	}
	f.env.Settle(searchindex.Name)
	f.noDrift(t)
	if versions, _ := searchindex.Versions(context.Background(), f.client, f.alias); len(versions) != 2 {
		t.Errorf("indices after the reindex: %v, want the old one kept", versions)
	}
}

func errString(err error) string {
	if err == nil {
		return "none"
	}
	return err.Error()
}

// Too many refused documents: the reindex stops before the swap and says
// which documents and why.
func TestReindexAbortsOnFailures(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 20)
	ctx := context.Background()
	id := firstProduct(t, f)
	if _, err := f.env.DB.Pool.Exec(ctx, `UPDATE products SET sku = repeat('Y', 40000) WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	before := f.current(t)
	_, err := f.reindexer().Reindex(ctx)
	if !errors.Is(err, searchindex.ErrTooManyFailures) || !strings.Contains(err.Error(), "document "+strconv.FormatInt(id, 10)) ||
		!strings.Contains(err.Error(), "immense term") {
		t.Fatalf("reindex with a refused document: %v; want ErrTooManyFailures naming the document and the reason", err)
	}
	if f.current(t) != before {
		t.Errorf("alias moved to %s after an aborted reindex", f.current(t))
	}
	if versions, _ := searchindex.Versions(ctx, f.client, f.alias); len(versions) != 1 {
		t.Errorf("indices after the abort: %v, want the new one removed", versions)
	}
	// With a threshold that tolerates it, the reindex goes through and
	// reports the refused document.
	r := f.reindexer()
	r.Search.ReindexMaxFailures = 1
	rep, err := r.Reindex(ctx)
	if err != nil {
		t.Fatalf("reindex tolerating one failure: %v", err)
	}
	if len(rep.Failures) != 1 || rep.Failures[0].ID != strconv.FormatInt(id, 10) || f.current(t) != rep.To {
		t.Errorf("reindex report %+v, alias at %s; want the one refused document reported and the alias swapped", rep, f.current(t))
	}
}

// --check finds what drifted and --repair fixes it.
func TestCheckAndRepair(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 30)
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	ctx := context.Background()
	cur := f.current(t)
	// Drift of every kind, behind fanout's back: a product created and one
	// changed without events, and a document for a product that never was.
	var missing, changed int64
	if err := f.env.DB.Pool.QueryRow(ctx, `
WITH p AS (INSERT INTO products (sku, name, brand_id, category_id, price)
           SELECT 'SKU-DRIFT', 'Drifter', brand_id, category_id, 1 FROM products LIMIT 1 RETURNING id)
INSERT INTO inventory (product_id, stock) SELECT id, 1 FROM p RETURNING product_id`).Scan(&missing); err != nil {
		t.Fatal(err)
	}
	if err := f.env.DB.Pool.QueryRow(ctx, `UPDATE products SET price = 0.01, version = version + 1 WHERE id = (SELECT min(id) FROM products) RETURNING id`).Scan(&changed); err != nil {
		t.Fatal(err)
	}
	if _, err := f.client.Bulk(ctx, cur, []search.Op{{ID: "987654", Version: 1, Doc: []byte(`{"id": 987654, "name": "ghost"}`)}}); err != nil {
		t.Fatal(err)
	}
	_ = f.client.Refresh(ctx, cur)
	d, err := searchindex.Check(ctx, f.client, f.env.DB.Pool, cur, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Missing) != 1 || d.Missing[0] != missing || len(d.Different) != 1 || d.Different[0] != changed || len(d.Extra) != 1 || d.Extra[0] != "987654" {
		t.Fatalf("check: %s; want missing %d, different %d, extra 987654", d, missing, changed)
	}
	rep, err := searchindex.Repair(ctx, f.client, f.env.DB.Pool, cur, 100, d)
	if err != nil || rep.Drifted != 3 || rep.Fixed != 3 || len(rep.Unrepaired) != 0 {
		t.Fatalf("repair: %v, %s; want the 3 drifted documents repaired", err, rep)
	}
	f.noDrift(t)
}

// corruptAtSameVersion overwrites product id's document in index with a
// wrong name under the version SQL has: drift that an external write of
// that version cannot replace (409). It returns that version.
func (f *fixture) corruptAtSameVersion(t *testing.T, index string, id int64) int64 {
	t.Helper()
	products, err := shop.LoadProducts(context.Background(), f.env.DB.Pool, []int64{id})
	if err != nil {
		t.Fatal(err)
	}
	p := products[id]
	p.Name = "CORRUPTED " + p.Name
	searchtest.Put(t, index, strconv.FormatInt(id, 10), p.Version, search.ExternalGTE, p)
	return p.Version
}

// A document that differs from SQL at the version SQL has is repaired, and
// the repair says so; one it cannot repair (its version is above SQL's) is
// named with the reason, and the repair returns ErrNotRepaired.
func TestRepairFixesSameVersionDriftAndNamesWhatItCannot(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 10)
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	ctx := context.Background()
	cur := f.current(t)
	var same, above int64
	if err := f.env.DB.Pool.QueryRow(ctx, `SELECT min(id), max(id) FROM products`).Scan(&same, &above); err != nil {
		t.Fatal(err)
	}
	version := f.corruptAtSameVersion(t, cur, same)
	products, err := shop.LoadProducts(ctx, f.env.DB.Pool, []int64{same, above})
	if err != nil {
		t.Fatal(err)
	}
	searchtest.Put(t, cur, strconv.FormatInt(above, 10), products[above].Version+100, search.External, products[above])

	d, err := searchindex.Check(ctx, f.client, f.env.DB.Pool, cur, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(d.Different, []int64{same, above}) || len(d.Missing)+len(d.Extra) != 0 {
		t.Fatalf("check: %s; want %d and %d different", d, same, above)
	}
	// What the indexer's own write does with it: a 409, counted as done.
	doc, _ := searchindex.Document(products[same])
	if r, err := f.client.Bulk(ctx, cur, []search.Op{{ID: strconv.FormatInt(same, 10), Version: version, Doc: doc}}); err != nil || r[0].Status != http.StatusConflict {
		t.Fatalf("external write at the same version: %+v, %v; want the 409 that hid this drift", r, err)
	}

	rep, err := searchindex.Repair(ctx, f.client, f.env.DB.Pool, cur, 100, d)
	if !errors.Is(err, searchindex.ErrNotRepaired) {
		t.Fatalf("repair with a document above SQL's version: %v; want ErrNotRepaired", err)
	}
	if rep.Drifted != 2 || rep.Fixed != 1 || len(rep.Unrepaired) != 1 || rep.Unrepaired[0].ID != strconv.FormatInt(above, 10) {
		t.Fatalf("repair report %s; want %d fixed and %d named", rep, same, above)
	}
	if reason := rep.Unrepaired[0].Reason; !strings.Contains(reason, fmt.Sprintf("version %d, above SQL's %d", products[above].Version+100, products[above].Version)) ||
		!strings.Contains(reason, "409") {
		t.Errorf("reason %q; want both versions and the engine's 409", reason)
	}
	if !f.inSync(same) {
		got, v, _ := f.doc(same)
		t.Errorf("document %d after the repair: %+v at version %d; want SQL's state at %d", same, got, v, version)
	}
	_ = f.client.Refresh(ctx, cur)
	if d, err := searchindex.Check(ctx, f.client, f.env.DB.Pool, cur, 0); err != nil || !slices.Equal(d.Different, []int64{above}) || d.Total() != 1 {
		t.Errorf("check after the repair: %s, %v; want only %d left", d, err, above)
	}
}

// Rollback returns the alias to the previous index and repairs what it
// missed while it was not current.
func TestRollback(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 30)
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	ctx := context.Background()
	if _, err := f.reindexer().Reindex(ctx); err != nil {
		t.Fatal(err)
	}
	// Changes that only the new index receives.
	d := &demo.Driver{Pool: f.env.DB.Pool, Rate: 200, Rand: rand.New(rand.NewPCG(2, 2)), Logger: f.env.Logger,
		Mix: demo.Mix{Price: 50, Stock: 20, Create: 15, Delete: 15}}
	lctx, cancel := context.WithTimeout(ctx, time.Second)
	_ = d.Run(lctx)
	cancel()
	f.env.Settle(searchindex.Name)
	// And a document of the old index that differs from SQL at SQL's
	// version: an external write cannot replace it.
	v1 := searchindex.IndexName(f.alias, 1)
	var corrupted int64
	if err := f.env.DB.Pool.QueryRow(ctx, `SELECT min(id) FROM products`).Scan(&corrupted); err != nil {
		t.Fatal(err)
	}
	f.corruptAtSameVersion(t, v1, corrupted)
	from, to, rep, err := searchindex.Rollback(ctx, f.client, f.env.DB.Pool, f.search)
	if err != nil {
		t.Fatal(err)
	}
	if from != searchindex.IndexName(f.alias, 2) || to != v1 || f.current(t) != to {
		t.Errorf("rollback from %s to %s, alias at %s", from, to, f.current(t))
	}
	if rep.Fixed == 0 || rep.Fixed != rep.Drifted || len(rep.Unrepaired) != 0 {
		t.Errorf("rollback repair %s; want every drifted document repaired, and some, since the old index missed a second of writes", rep)
	}
	if !f.inSync(corrupted) {
		t.Errorf("document %d, corrupted at SQL's version, is still wrong after the rollback", corrupted)
	}
	f.noDrift(t)
}

// The commands that change index versions run one at a time per alias,
// and a command that ends (or dies: its connection closes) lets the next
// one in.
func TestReindexLockIsExclusive(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 1)
	ctx := context.Background()
	unlock, err := searchindex.Lock(ctx, f.env.DB.Pool, f.alias)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := searchindex.Lock(ctx, f.env.DB.Pool, f.alias); !errors.Is(err, searchindex.ErrBusy) || !strings.Contains(err.Error(), f.alias) ||
		!regexp.MustCompile(`backend [0-9]+ holds`).MatchString(err.Error()) {
		t.Fatalf("second lock while the first is held: %v; want ErrBusy naming the alias and the holder's pid", err)
	}
	other, err := searchindex.Lock(ctx, f.env.DB.Pool, f.alias+"-other")
	if err != nil {
		t.Fatalf("lock of another alias: %v, want it independent", err)
	}
	other()
	unlock()
	again, err := searchindex.Lock(ctx, f.env.DB.Pool, f.alias)
	if err != nil {
		t.Fatalf("lock after the unlock: %v", err)
	}
	again()
}

// A reindex with stream.provision auto brings a replay consumer that
// differs from its configuration (a filter of its own) to it, reads
// through it, and leaves it as configured.
func TestReindexBringsItsReplayConsumerToItsConfiguration(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 20)
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	ctx := context.Background()
	events, err := f.env.JS.Stream(ctx, f.env.Config.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	leftover := searchindex.ReplayConsumerConfig(f.env.Config.Stream)
	leftover.FilterSubjects = []string{"events.brand.updated"}
	if _, err := events.CreateConsumer(ctx, leftover); err != nil {
		t.Fatal(err)
	}
	// Changes during the reindex, so it has events to replay.
	rep, err := f.reindexUnderLoad(200, 9, demo.Mix{Price: 80, Stock: 20})
	if err != nil {
		t.Fatalf("reindex with a leftover replay consumer: %v", err)
	}
	if rep.Replayed == 0 {
		t.Errorf("reindex replayed no event: %+v", rep)
	}
	c, err := events.Consumer(ctx, stream.ReindexConsumer)
	if err != nil {
		t.Fatalf("replay consumer after the reindex: %v", err)
	}
	if ds := stream.ReaderDifferences(c.CachedInfo().Config, searchindex.ReplayConsumerConfig(f.env.Config.Stream)); len(ds) > 0 {
		t.Errorf("replay consumer after the reindex: %s", stream.Join(ds))
	}
	f.env.Settle(searchindex.Name)
	f.noDrift(t)
}

// Products that change faster than a verification round (every product
// here changes dozens of times a second) are behind SQL at every check; the
// reindex still verifies and swaps, because each replay brings them to the
// version SQL had before it.
func TestReindexVerifiesHotProducts(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 5)
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	rep, err := f.reindexUnderLoad(300, 11, demo.Mix{Price: 50, Stock: 50})
	if err != nil {
		t.Fatalf("reindex under hot updates: %v", err)
	}
	if f.current(t) != rep.To {
		t.Errorf("alias at %s after the reindex, want %s", f.current(t), rep.To)
	}
	f.env.Settle(searchindex.Name)
	f.noDrift(t)
}

// A load that takes longer than postgres.statement_timeout still goes
// through: it reads its snapshot in short statements. (A full check reads
// pages of 5000 products: under the 300 ms timeout, one of them took
// longer on a CI host busy with eight fault runs, so the check that the
// index holds every product runs without it.)
func TestReindexOutlastsTheStatementTimeout(t *testing.T) {
	t.Parallel()
	const products = 15000
	f := newFixture(t, search.OpenSearch, products)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(f.env.DB.URL)
	if err != nil {
		t.Fatal(err)
	}
	// The whole load takes longer (about 0.9 s on an idle host: 6000
	// products loaded in 375 ms), a page of 25 far less (a few ms; a page
	// of 100 once took over 100 ms, and a statement of a reindex over 150
	// ms, on a host busy with the fault run).
	const timeout = 300 * time.Millisecond
	cfg.ConnConfig.RuntimeParams["statement_timeout"] = strconv.Itoa(int(timeout.Milliseconds()))
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	r := f.reindexer()
	r.Pool, r.PageSize = pool, 25
	rep, err := r.Reindex(ctx)
	if err != nil {
		t.Fatalf("reindex with a %s statement timeout: %v", timeout, err)
	}
	if rep.Snapshot != products || rep.Loaded != products || rep.LoadTime < timeout {
		t.Errorf("reindex: %+v; want %d of %d loaded, in longer than the statement timeout", rep, products, products)
	}
	d, err := searchindex.Check(ctx, f.client, f.env.DB.Pool, rep.To, 0)
	if err != nil || d.Total() != 0 {
		t.Errorf("full check of the reindexed index: %v, drift %s", err, d)
	}
}
