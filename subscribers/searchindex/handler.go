package searchindex

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/fanout/fanout/internal/metrics"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Name is the subscriber's durable name.
const Name = "searchindex"

// Handler indexes product documents.
type Handler struct {
	syncer
	alias   string
	refresh *refresher // nil when search.refresh_after is 0
}

// New returns the search indexer writing through cfg.Alias.
func New(client *search.Client, pool *pgxpool.Pool, cfg Config, logger *slog.Logger) *Handler {
	h := &Handler{
		syncer: syncer{client: client, pool: pool, bulkSize: cfg.BulkSize, logger: logger,
			retryWaits: []time.Duration{200 * time.Millisecond, 800 * time.Millisecond}},
		alias: cfg.Alias,
	}
	if cfg.RefreshAfter > 0 {
		timeout := cfg.Timeout
		if timeout <= 0 {
			timeout = 10 * time.Second
		}
		h.refresh = newRefresher(client, cfg.Alias, cfg.RefreshAfter, timeout, logger)
	}
	return h
}

// Close makes the writes still waiting for their refresh searchable now
// and stops the refresher (the runner calls it when it stops).
func (h *Handler) Close() error {
	h.refresh.close()
	return nil
}

// ObserveSearchable has f told, after each refresh the indexer makes, how
// long each event's write waited to become searchable (nothing when
// search.refresh_after is 0).
func (h *Handler) ObserveSearchable(f func([]time.Duration)) {
	if h.refresh != nil {
		h.refresh.observe = f
	}
}

// ObserveBulkItems has f told every bulk item's outcome: ok, conflict,
// not_found (a deletion of a document already gone), retry (429, 5xx),
// failed (a 404 that is not that: no index to write to) or rejected.
func (h *Handler) ObserveBulkItems(f func(outcome string)) { h.items = f }

// Dependencies: the search engine, probed with its info endpoint.
func (h *Handler) Dependencies() []subscribers.Dependency {
	return []subscribers.Dependency{{Name: Dependency, Probe: func(ctx context.Context) error {
		_, err := h.client.Info(ctx)
		return err
	}}}
}

// eventTypes: every product change, and brand and category renames (their
// names are in the documents of all their products).
var eventTypes = []string{"product.>", shop.BrandUpdated, shop.CategoryUpdated}

// Subscriber declares the search indexer to fanout. Building it makes sure
// the alias points at an index (per search.provision) before it starts.
var Subscriber = subscribers.Declaration{
	Name:       Name,
	EventTypes: eventTypes,
	Uses:       []subscribers.Service{subscribers.Search},
	Grants:     []string{"SELECT ON products, brands, categories, inventory"},
	New: func(d subscribers.Deps) (subscribers.Handler, error) {
		var cfg Config
		if err := d.Settings.Section("search", &cfg); err != nil {
			return subscribers.Handler{}, err
		}
		if err := EnsureIndex(d.Context, d.Search, cfg.Alias, cfg.Provision); err != nil {
			return subscribers.Handler{}, err
		}
		h := New(d.Search, d.Pool, cfg, d.Logger)
		if d.Metrics != nil {
			h.ObserveBulkItems(NewBulkItems(d.Metrics).BulkItem)
			stages := metrics.StagesOf(d.Metrics)
			h.ObserveSearchable(func(took []time.Duration) { stages.Observe(metrics.StageSearchable, Name, took...) })
		}
		return subscribers.Each(h), nil
	},
}

// Handle indexes one event's products.
func (h *Handler) Handle(ctx context.Context, ev subscribers.Event) error {
	return h.HandleBatch(ctx, []subscribers.Event{ev})[0]
}

// HandleBatch indexes the products a batch of events changed, each product
// once, in bulk, and reports each event's outcome.
func (h *Handler) HandleBatch(ctx context.Context, evs []subscribers.Event) []error {
	errs, products, brands, categories := targets(evs)
	if len(brands) > 0 {
		if err := groupProducts(ctx, h.pool, productsOfBrands, brands, products); err != nil {
			return fill(errs, fmt.Errorf("products of renamed brands: %w", err))
		}
	}
	if len(categories) > 0 {
		if err := groupProducts(ctx, h.pool, productsOfCategories, categories, products); err != nil {
			return fill(errs, fmt.Errorf("products of renamed categories: %w", err))
		}
	}
	var ids []int64
	for _, p := range products {
		ids = append(ids, p...)
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	outcomes, err := h.sync(ctx, h.alias, ids)
	if err != nil {
		return fill(errs, fmt.Errorf("index %d products: %w", len(ids), err))
	}
	writtenAt, written := time.Now(), 0
	for i := range evs {
		if errs[i] == nil {
			errs[i] = eventOutcome(products[i], outcomes)
		}
		if errs[i] == nil {
			written++
		}
	}
	h.refresh.written(written, writtenAt)
	return errs
}

// eventOutcome is an event's outcome, from its products' documents': a
// permanent error if one was rejected, else the first transient one.
func eventOutcome(products []int64, outcomes map[int64]docOutcome) error {
	var transient error
	for _, id := range products {
		o := outcomes[id]
		if o.permanent != nil {
			return subscribers.Permanent(o.permanent)
		}
		if transient == nil {
			transient = o.transient
		}
	}
	return transient
}

// targets reads what each event names: the products it changed
// (products, by event), or the brands and categories it renamed (by id,
// the events renaming each). An event that names nothing it can read has
// its permanent error in errs.
func targets(evs []subscribers.Event) (errs []error, products [][]int64, brands, categories map[int64][]int) {
	errs = make([]error, len(evs))
	products = make([][]int64, len(evs))
	brands, categories = map[int64][]int{}, map[int64][]int{}
	for i, ev := range evs {
		switch ev.Type {
		case shop.BrandUpdated:
			var p shop.BrandEvent
			if err := json.Unmarshal(ev.Payload, &p); err != nil || p.BrandID <= 0 {
				errs[i] = subscribers.Permanent(fmt.Errorf("malformed brand.updated payload %.200q: %v", ev.Payload, err))
				continue
			}
			brands[p.BrandID] = append(brands[p.BrandID], i)
		case shop.CategoryUpdated:
			var p shop.CategoryEvent
			if err := json.Unmarshal(ev.Payload, &p); err != nil || p.CategoryID <= 0 {
				errs[i] = subscribers.Permanent(fmt.Errorf("malformed category.updated payload %.200q: %v", ev.Payload, err))
				continue
			}
			categories[p.CategoryID] = append(categories[p.CategoryID], i)
		default:
			id, err := productID(ev)
			if err != nil {
				errs[i] = subscribers.Permanent(err)
				continue
			}
			products[i] = []int64{id}
		}
	}
	return errs, products, brands, categories
}

func productID(ev subscribers.Event) (int64, error) {
	var p shop.ProductEvent
	if err := json.Unmarshal(ev.Payload, &p); err != nil {
		return 0, fmt.Errorf("malformed %s payload %.200q: %v", ev.Type, ev.Payload, err)
	}
	if p.ProductID > 0 {
		return p.ProductID, nil
	}
	if id, err := strconv.ParseInt(ev.AggregateID, 10, 64); err == nil && id > 0 {
		return id, nil
	}
	return 0, fmt.Errorf("%s event names no product (payload %.200q, aggregate %q)", ev.Type, ev.Payload, ev.AggregateID)
}

// The products of groups (brands, categories), as (group id, product id)
// rows, for groupProducts.
const (
	productsOfBrands     = `SELECT brand_id, id FROM products WHERE brand_id = ANY($1)`
	productsOfCategories = `SELECT category_id, id FROM products WHERE category_id = ANY($1)`
)

// groupProducts adds to each event renaming a group (a brand, a category)
// the products of that group, as query lists them. A rename bumped their
// versions in its transaction, so the documents written now replace the old
// ones whatever the indexers race.
func groupProducts(ctx context.Context, pool *pgxpool.Pool, query string, groups map[int64][]int, products [][]int64) error {
	ids := make([]int64, 0, len(groups))
	for id := range groups {
		ids = append(ids, id)
	}
	rows, err := pool.Query(ctx, query, ids)
	if err != nil {
		return err
	}
	var groupID, productID int64
	_, err = pgx.ForEachRow(rows, []any{&groupID, &productID}, func() error {
		for _, i := range groups[groupID] {
			products[i] = append(products[i], productID)
		}
		return nil
	})
	return err
}

// fill sets err on every event that has no outcome yet.
func fill(errs []error, err error) []error {
	for i := range errs {
		if errs[i] == nil {
			errs[i] = err
		}
	}
	return errs
}
