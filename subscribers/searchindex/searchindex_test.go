package searchindex_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/shop/demo"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fixture is one test's pipeline plus an index of its own.
type fixture struct {
	env    *subscribertest.Env
	client *search.Client
	alias  string
	search searchindex.Config // the indexer's settings, its alias f.alias
}

func newFixture(t *testing.T, engine string, products int) *fixture {
	env := subscribertest.NewEnv(t)
	f := &fixture{env: env, client: searchtest.Client(t, engine), search: searchindex.DefaultConfig()}
	f.alias = searchtest.Alias(t, f.client)
	f.search.Alias = f.alias
	if err := searchindex.EnsureIndex(context.Background(), f.client, f.alias, "auto"); err != nil {
		t.Fatal(err)
	}
	if products > 0 {
		if _, err := shop.Seed(context.Background(), env.DB.Pool, products, rand.New(rand.NewPCG(9, 9))); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

func (f *fixture) handler() subscribers.Handler {
	return subscribers.Each(f.indexer())
}

// subscriber is the search indexer as its package declares it, with the
// fixture's handler.
func (f *fixture) subscriber() subscribers.Declaration {
	return subscribertest.HandledBy(searchindex.Subscriber, f.handler())
}

// indexer is the search indexer itself, for what the tests call directly.
func (f *fixture) indexer() *searchindex.Handler {
	h := searchindex.New(f.client, f.env.DB.Pool, f.search, f.env.Logger)
	f.env.T.Cleanup(func() { _ = h.Close() }) // its refresher, before the client closes
	return h
}

// doc returns the indexed product, or found false.
func (f *fixture) doc(id int64) (shop.Product, int64, bool) {
	f.env.T.Helper()
	ctx := context.Background()
	docs, err := f.client.MGet(ctx, f.alias, []string{strconv.FormatInt(id, 10)})
	if err != nil {
		f.env.T.Fatal(err)
	}
	d, ok := docs[strconv.FormatInt(id, 10)]
	if !ok {
		return shop.Product{}, 0, false
	}
	var p shop.Product
	if err := json.Unmarshal(d.Source, &p); err != nil {
		f.env.T.Fatal(err)
	}
	return p, d.Version, true
}

// inSync reports whether product id's document equals its SQL state (or is
// absent for a deleted product).
func (f *fixture) inSync(id int64) bool {
	products, err := shop.LoadProducts(context.Background(), f.env.DB.Pool, []int64{id})
	if err != nil {
		f.env.T.Fatal(err)
	}
	p, exists := products[id]
	got, version, found := f.doc(id)
	if !exists {
		return !found
	}
	return found && got == p && version == p.Version
}

func (f *fixture) noDrift(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	cur, err := searchindex.Current(ctx, f.client, f.alias)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.client.Refresh(ctx, cur); err != nil {
		t.Fatal(err)
	}
	d, err := searchindex.Check(ctx, f.client, f.env.DB.Pool, cur, 0)
	if err != nil {
		t.Fatal(err)
	}
	if d.Total() != 0 {
		t.Fatalf("index drifted from SQL: %s", d)
	}
}

func firstProduct(t *testing.T, f *fixture) int64 {
	var id int64
	if err := f.env.DB.Pool.QueryRow(context.Background(), `SELECT min(id) FROM products`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// The conformance suite, over both implementations against the real engine.
func TestConformance(t *testing.T) {
	for _, engine := range searchtest.Engines {
		t.Run(engine, func(t *testing.T) {
			var mu sync.Mutex
			fixtures := map[*subscribertest.Env]*fixture{}
			get := func(env *subscribertest.Env) *fixture {
				mu.Lock()
				defer mu.Unlock()
				f, ok := fixtures[env]
				if !ok {
					f = &fixture{env: env, client: searchtest.Client(env.T, engine), search: searchindex.DefaultConfig()}
					f.alias = searchtest.Alias(env.T, f.client)
					f.search.Alias = f.alias
					if err := searchindex.EnsureIndex(context.Background(), f.client, f.alias, "auto"); err != nil {
						env.T.Fatal(err)
					}
					fixtures[env] = f
				}
				return f
			}
			subscribertest.Run(t, subscribertest.Case{
				Subscriber: searchindex.Subscriber,
				Handler:    func(env *subscribertest.Env) subscribers.Handler { return get(env).handler() },
				Valid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, error) {
					ctx := context.Background()
					if _, err := tx.Exec(ctx, `INSERT INTO brands (name) VALUES ('Acme') ON CONFLICT DO NOTHING`); err != nil {
						return outbox.Event{}, err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO categories (name) VALUES ('phones') ON CONFLICT DO NOTHING`); err != nil {
						return outbox.Event{}, err
					}
					var id int64
					err := tx.QueryRow(ctx, `
WITH p AS (INSERT INTO products (sku, name, brand_id, category_id, price)
           SELECT 'SKU-' || gen_random_uuid(), 'Phone', (SELECT min(id) FROM brands), (SELECT min(id) FROM categories), 99
           RETURNING id)
INSERT INTO inventory (product_id, stock) SELECT id, 5 FROM p RETURNING product_id`).Scan(&id)
					price := int64(9900)
					return outbox.Event{AggregateType: "product", AggregateID: strconv.FormatInt(id, 10), Type: shop.ProductCreated,
						Payload: shop.ProductEvent{ProductID: id, Version: 1, PriceCents: &price}}, err
				},
				Effects: func(env *subscribertest.Env, ev outbox.Event, _ int64) int {
					f := get(env)
					_ = f.client.Refresh(context.Background(), f.alias)
					if _, _, found := f.doc(ev.Payload.(shop.ProductEvent).ProductID); found && f.inSync(ev.Payload.(shop.ProductEvent).ProductID) {
						return 1
					}
					return 0
				},
				Invalid: func(env *subscribertest.Env, tx pgx.Tx) (outbox.Event, string, error) {
					return outbox.Event{AggregateType: "product", AggregateID: "x", Type: shop.ProductUpdated,
						Payload: []byte(`{"price_cents": 1}`)}, "names no product", nil
				},
			})
		})
	}
}

// Every kind of change reaches the index: price, stock, brand rename (all
// the brand's products), create, delete.
func TestChangesReachTheIndex(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 20)
	f.env.StartRunner(f.subscriber(), nil)
	ctx := context.Background()
	f.env.Settle(searchindex.Name) // the seed's product.created events
	id := firstProduct(t, f)
	var brandID int64
	if err := f.env.DB.Pool.QueryRow(ctx, `SELECT brand_id FROM products WHERE id = $1`, id).Scan(&brandID); err != nil {
		t.Fatal(err)
	}
	var created, deleted int64
	ids := f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		if _, err := shop.UpdatePrice(ctx, tx, id, 123456); err != nil {
			return nil, err
		}
		if _, err := shop.ChangeStock(ctx, tx, id, 7); err != nil {
			return nil, err
		}
		if _, err := shop.RenameBrand(ctx, tx, brandID, "Zeta Corp"); err != nil {
			return nil, err
		}
		p, err := shop.RandomProduct(ctx, tx, rand.New(rand.NewPCG(1, 9)))
		if err != nil {
			return nil, err
		}
		if created, err = shop.CreateProduct(ctx, tx, p); err != nil {
			return nil, err
		}
		if err := tx.QueryRow(ctx, `SELECT max(id) FROM products WHERE id <> $1 AND id <> $2`, id, created).Scan(&deleted); err != nil {
			return nil, err
		}
		_, err = shop.DeleteProduct(ctx, tx, deleted)
		return nil, err
	})
	_ = ids
	subscribertest.WaitFor(t, 15*time.Second, "the changes indexed", func() (bool, string) {
		_ = f.client.Refresh(ctx, f.alias)
		got, _, _ := f.doc(id)
		_, _, deletedFound := f.doc(deleted)
		_, _, createdFound := f.doc(created)
		return got.PriceCents == 123456 && got.Brand == "Zeta Corp" && !deletedFound && createdFound, fmt.Sprintf("%+v", got)
	})
	f.env.WaitIdle(searchindex.Name, 10*time.Second)
	f.noDrift(t)
	// Every product of the renamed brand carries the new name.
	res, err := f.client.Search(ctx, f.alias, map[string]any{"query": map[string]any{"term": map[string]any{"brand_id": brandID}}, "size": 100})
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range res.Hits {
		var p shop.Product
		_ = json.Unmarshal(h.Source, &p)
		if p.Brand != "Zeta Corp" {
			t.Errorf("product %d of the renamed brand still says %q", p.ID, p.Brand)
		}
	}
	// The analyzer: a search by a word of the name, in another case, finds it.
	got, _, _ := f.doc(id)
	word := strings.ToUpper(strings.Fields(got.Name)[1])
	res, err = f.client.Search(ctx, f.alias, map[string]any{"query": map[string]any{"match": map[string]any{"name": word}}})
	if err != nil || res.Total == 0 {
		t.Errorf("searching name for %q: %d hits, %v", word, res.Total, err)
	}
}

// A document the mapping rejects goes to the dead letters with its id and
// the engine's reason; the events around it flow.
func TestRejectedDocumentIsDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 3)
	f.env.StartRunner(f.subscriber(), nil)
	ctx := context.Background()
	f.env.Settle(searchindex.Name)
	id := firstProduct(t, f)
	// A keyword over Lucene's 32766-byte term limit: the engine refuses it.
	if _, err := f.env.DB.Pool.Exec(ctx, `UPDATE products SET sku = repeat('X', 40000), version = version + 1 WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	var other int64
	_ = f.env.DB.Pool.QueryRow(ctx, `SELECT max(id) FROM products`).Scan(&other)
	f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		if _, err := shop.UpdatePrice(ctx, tx, id, 1); err != nil {
			return nil, err
		}
		_, err := shop.UpdatePrice(ctx, tx, other, 4242)
		return nil, err
	})
	subscribertest.WaitFor(t, 15*time.Second, "the dead letter", func() (bool, string) { return len(f.env.DeadLetters(searchindex.Name)) == 1, "" })
	reason := f.env.DeadLetters(searchindex.Name)[0].Header.Get(subscribers.DeadReasonHeader)
	if !strings.Contains(reason, "document "+strconv.FormatInt(id, 10)+" rejected") || !strings.Contains(reason, "immense term") {
		t.Errorf("dead letter reason %q, want the document id and the engine's reason", reason)
	}
	subscribertest.WaitFor(t, 10*time.Second, "the other product indexed", func() (bool, string) {
		_ = f.client.Refresh(ctx, f.alias)
		p, _, _ := f.doc(other)
		return p.PriceCents == 4242, ""
	})
}

// setBlock puts or lifts the engine's read-only-allow-delete block, under
// which every write is answered 429: the engine refusing load, for real.
func setBlock(t *testing.T, index string, on bool) {
	body := fmt.Sprintf(`{"index.blocks.read_only_allow_delete": %v}`, map[bool]string{true: "true", false: "null"}[on])
	req, _ := http.NewRequest(http.MethodPut, searchtest.URL()+"/"+index+"/_settings", bytes.NewReader([]byte(body)))
	req.Header.Set("Content-Type", "application/json")
	hc := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	defer hc.CloseIdleConnections()
	res, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 {
		t.Fatalf("set block: %d %s", res.StatusCode, b)
	}
}

func TestThrottledWritesAreRetriedUntilTheyPass(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 3)
	ctx := context.Background()
	cur, _ := searchindex.Current(ctx, f.client, f.alias)
	// A throttled engine is an outage, not the event's failure: with
	// max_failures 1, one counted failure would dead-letter the event.
	f.env.Config.Subscribers.MaxFailures = 1
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	id := firstProduct(t, f)
	setBlock(t, cur, true)
	t.Cleanup(func() { setBlock(t, cur, false) })
	f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		_, err := shop.UpdatePrice(ctx, tx, id, 31337)
		return nil, err
	})
	time.Sleep(2 * time.Second) // several attempts, all answered 429
	if p, _, _ := f.doc(id); p.PriceCents == 31337 {
		t.Fatal("the write passed a read-only block")
	}
	if n := len(f.env.DeadLetters(searchindex.Name)); n != 0 {
		t.Fatalf("%d dead letters for a throttled write, want 0", n)
	}
	setBlock(t, cur, false)
	subscribertest.WaitFor(t, 20*time.Second, "the write after the block", func() (bool, string) {
		_ = f.client.Refresh(ctx, f.alias)
		p, _, _ := f.doc(id)
		return p.PriceCents == 31337, ""
	})
}

// A late write of an older state (an indexer that read the row before the
// change) neither overwrites a newer document nor undoes a deletion.
func TestStaleWritesLose(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 3)
	ctx := context.Background()
	f.env.StartRunner(f.subscriber(), nil)
	f.env.Settle(searchindex.Name)
	id := firstProduct(t, f)
	stale, _ := shop.LoadProducts(ctx, f.env.DB.Pool, []int64{id})
	f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		_, err := shop.UpdatePrice(ctx, tx, id, 555)
		return nil, err
	})
	subscribertest.WaitFor(t, 10*time.Second, "the new price", func() (bool, string) { return f.inSync(id), "" })
	write := func() search.Result {
		doc, _ := searchindex.Document(stale[id])
		res, err := f.client.Bulk(ctx, f.alias, []search.Op{{ID: strconv.FormatInt(id, 10), Version: stale[id].Version, Doc: doc}})
		if err != nil {
			t.Fatal(err)
		}
		return res[0]
	}
	if r := write(); r.Status != http.StatusConflict {
		t.Errorf("stale write over a newer document: %d, want 409", r.Status)
	}
	f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		_, err := shop.DeleteProduct(ctx, tx, id)
		return nil, err
	})
	subscribertest.WaitFor(t, 10*time.Second, "the deletion", func() (bool, string) { _, _, found := f.doc(id); return !found, "" })
	if r := write(); r.Status != http.StatusConflict {
		t.Errorf("stale write after the deletion: %d, want 409", r.Status)
	}
	if _, _, found := f.doc(id); found {
		t.Error("a stale write brought a deleted product back")
	}
}

// A storm of random writes with two indexer instances: afterwards every
// document equals its SQL row, and no deleted product has one.
func TestStormConverges(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 60)
	f.env.Config.Subscribers.BatchSize = 20
	f.env.StartRunner(f.subscriber(), nil)
	f.env.StartRunner(f.subscriber(), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// Four writers hammering 60 products (and few brands): many quick
	// updates to the same product, racing across the two instances.
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			d := &demo.Driver{Pool: f.env.DB.Pool, Rate: 100, Rand: rand.New(rand.NewPCG(uint64(w), 3)), Logger: f.env.Logger,
				Mix: demo.Mix{Price: 35, Stock: 35, Order: 0, Create: 10, Delete: 10, RenameBrand: 5, RenameCategory: 5}}
			_ = d.Run(ctx)
		})
	}
	wg.Wait()
	var ids []int64
	rows, _ := f.env.DB.Pool.Query(context.Background(), `SELECT id FROM outbox`)
	ids, _ = pgx.CollectRows(rows, pgx.RowTo[int64])
	f.env.WaitSent(ids...)
	f.env.WaitIdle(searchindex.Name, 30*time.Second)
	f.noDrift(t)
	var deleted, categories int
	_ = f.env.DB.Pool.QueryRow(context.Background(), `
SELECT count(*) FILTER (WHERE event_type = 'product.deleted'), count(*) FILTER (WHERE event_type = 'category.updated') FROM outbox`).Scan(&deleted, &categories)
	t.Logf("%d events, %d products deleted, %d categories renamed", len(ids), deleted, categories)
	if deleted == 0 || categories == 0 {
		t.Error("the storm deleted no product or renamed no category: the test proves less than it claims")
	}
}

// A category rename reaches every product document of that category, in
// bulk, each product once, and no other document.
func TestCategoryRenameReachesItsProducts(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 60)
	h := f.indexer()
	var mu sync.Mutex
	items := map[string]int{}
	h.ObserveBulkItems(func(outcome string) { mu.Lock(); items[outcome]++; mu.Unlock() })
	f.env.StartRunner(subscribertest.HandledBy(searchindex.Subscriber, subscribers.Each(h)), nil)
	f.env.Settle(searchindex.Name)
	ctx := context.Background()
	_ = f.client.Refresh(ctx, f.alias)

	var categoryID int64
	var old string
	if err := f.env.DB.Pool.QueryRow(ctx, `
SELECT c.id, c.name FROM products p JOIN categories c ON c.id = p.category_id
GROUP BY c.id, c.name ORDER BY count(*) DESC, c.id LIMIT 1`).Scan(&categoryID, &old); err != nil {
		t.Fatal(err)
	}
	// Every document before the rename, to tell the others were left alone.
	before := map[int64]search.Doc{}
	if err := f.client.Scan(ctx, f.alias, "id", func(d search.Doc) error {
		id, _ := strconv.ParseInt(d.ID, 10, 64)
		before[id] = d
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var inCategory []int64
	for id, d := range before {
		var p shop.Product
		_ = json.Unmarshal(d.Source, &p)
		if p.CategoryID == categoryID {
			inCategory = append(inCategory, id)
		}
	}
	if len(inCategory) < 2 || len(inCategory) == len(before) {
		t.Fatalf("%d of %d products in category %d: the test needs several, and products outside it", len(inCategory), len(before), categoryID)
	}
	mu.Lock()
	clear(items)
	mu.Unlock()

	var renamed int64
	f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		var err error
		renamed, err = shop.RenameCategory(ctx, tx, categoryID, old+" renamed")
		return nil, err
	})
	f.env.WaitSent(renamed)
	f.env.WaitIdle(searchindex.Name, 15*time.Second)
	if err := f.client.Refresh(ctx, f.alias); err != nil {
		t.Fatal(err)
	}
	res, err := f.client.Search(ctx, f.alias, map[string]any{"size": 1000, "version": true, "query": map[string]any{"term": map[string]any{"category_id": categoryID}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Hits) != len(inCategory) {
		t.Errorf("%d documents of category %d after the rename, want %d", len(res.Hits), categoryID, len(inCategory))
	}
	for _, h := range res.Hits {
		var p shop.Product
		_ = json.Unmarshal(h.Source, &p)
		if p.Category != old+" renamed" || h.Version != before[p.ID].Version+1 {
			t.Errorf("product %d of the renamed category: %q at version %d, want %q at %d", p.ID, p.Category, h.Version, old+" renamed", before[p.ID].Version+1)
		}
	}
	if err := f.client.Scan(ctx, f.alias, "id", func(d search.Doc) error {
		id, _ := strconv.ParseInt(d.ID, 10, 64)
		if !slices.Contains(inCategory, id) && (d.Version != before[id].Version || !bytes.Equal(d.Source, before[id].Source)) {
			t.Errorf("product %d of another category was rewritten: version %d → %d", id, before[id].Version, d.Version)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// One write per product of the category, no other.
	mu.Lock()
	defer mu.Unlock()
	if items["ok"] != len(inCategory) || len(items) != 1 {
		t.Errorf("bulk items for the rename: %v, want %d ok", items, len(inCategory))
	}
	if n := len(f.env.DeadLetters(searchindex.Name)); n != 0 {
		t.Errorf("%d dead letters, want none", n)
	}
	f.noDrift(t)
}

// When the index behind the alias is gone and the engine may not create
// one, a write is a 404 index_not_found_exception: not done. The event is
// retried (it is not the event's fault, and the engine answers), then
// dead-lettered with the engine's reason once subscribers.max_failures
// attempts have failed; nothing was acked as indexed. Before that, a
// deletion of a document the index never had is done, as always.
func TestMissingIndexIsRetriedThenDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t, search.OpenSearch, 3)
	const maxFailures = 3
	f.env.Config.Subscribers.MaxFailures = maxFailures
	h := f.indexer()
	var mu sync.Mutex
	items := map[string]int{}
	h.ObserveBulkItems(func(outcome string) { mu.Lock(); items[outcome]++; mu.Unlock() })
	f.env.StartRunner(subscribertest.HandledBy(searchindex.Subscriber, subscribers.Each(h)), nil)
	f.env.Settle(searchindex.Name)
	ctx := context.Background()

	// A product deleted before its document was ever written: a delete of
	// a missing document, done.
	var never int64
	if err := f.env.DB.Pool.QueryRow(ctx, `
WITH p AS (INSERT INTO products (sku, name, brand_id, category_id, price)
           SELECT 'SKU-NEVER', 'Never indexed', brand_id, category_id, 1 FROM products LIMIT 1 RETURNING id)
INSERT INTO inventory (product_id, stock) SELECT id, 1 FROM p RETURNING product_id`).Scan(&never); err != nil {
		t.Fatal(err)
	}
	var deleted int64
	f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		var err error
		deleted, err = shop.DeleteProduct(ctx, tx, never)
		return nil, err
	})
	subscribertest.WaitFor(t, 10*time.Second, "the deletion of a missing document done", func() (bool, string) {
		return f.env.Checkpointed(searchindex.Name, deleted), ""
	})
	mu.Lock()
	notFound := items["not_found"]
	mu.Unlock()
	if notFound != 1 || len(f.env.DeadLetters(searchindex.Name)) != 0 {
		t.Fatalf("deletion of a missing document: %d not_found items, %d dead letters; want 1 and none", notFound, len(f.env.DeadLetters(searchindex.Name)))
	}

	// The index goes, and the alias with it; the engine may not create an
	// index of this test's names (the cluster setting is restored at the
	// end, and other tests' names are unaffected).
	searchtest.ForbidAutoCreate(t, f.alias+"*")
	t.Cleanup(func() { _ = f.client.DeleteIndex(context.Background(), f.alias) }) // if the engine made one after all
	if err := f.client.DeleteIndex(ctx, f.current(t)); err != nil {
		t.Fatal(err)
	}
	id := firstProduct(t, f)
	var other int64
	_ = f.env.DB.Pool.QueryRow(ctx, `SELECT max(id) FROM products`).Scan(&other)
	f.env.Write(func(tx pgx.Tx) ([]outbox.Event, error) {
		if _, err := shop.UpdatePrice(ctx, tx, id, 4321); err != nil {
			return nil, err
		}
		_, err := shop.DeleteProduct(ctx, tx, other)
		return nil, err
	})
	subscribertest.WaitFor(t, 30*time.Second, "both events dead-lettered", func() (bool, string) {
		n := len(f.env.DeadLetters(searchindex.Name))
		return n == 2, fmt.Sprintf("%d dead letters", n)
	})
	for _, dl := range f.env.DeadLetters(searchindex.Name) {
		reason := dl.Header.Get(subscribers.DeadReasonHeader)
		t.Logf("dead letter %s: %s", dl.Subject, reason)
		if !strings.Contains(reason, fmt.Sprintf("gave up after %d failures", maxFailures)) || !strings.Contains(reason, "index_not_found_exception") ||
			!strings.Contains(reason, "not written") {
			t.Errorf("dead letter %s: reason %q; want the failures counted to max_failures and the engine's index_not_found_exception", dl.Subject, reason)
		}
	}
	mu.Lock()
	failed := items["failed"]
	mu.Unlock()
	if failed < 2*maxFailures {
		t.Errorf("%d failed bulk items, want at least %d (each event tried %d times)", failed, 2*maxFailures, maxFailures)
	}
	if names, _ := f.client.Indices(ctx, f.alias); len(names) != 0 {
		t.Errorf("the engine created %v: the test proves nothing", names)
	}
}
