// Command search is the search benchmark (`go tool task bench:search`). In
// one run it prints: a bulk load of 1,000,000 generated products into a new
// index by `fanout reindex` (docs/s and the loader's peak RSS); steady
// indexing of live updates with 1 and 2 indexer instances (events/s); and
// freshness, commit to searchable, p50/p99 at 500 writes/s with the default
// refresh interval.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fanout/fanout/internal/benchkit"
	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/pgtest"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var (
	products  = flag.Int("products", 1_000_000, "products to load")
	updates   = flag.Int("updates", 50_000, "live update events for the steady-indexing runs")
	rate      = flag.Int("rate", 500, "writes/s of the freshness run")
	freshFor  = flag.Duration("fresh", 20*time.Second, "how long the freshness run lasts")
	pollEvery = flag.Duration("poll", 50*time.Millisecond, "how often the freshness searcher polls")
	loaders   = flag.Int("loaders", 3, "bulk requests in flight in the loader")
	natsURL   = flag.String("nats", config.DefaultNATSURL, "nats-server URL")
	searchURL = flag.String("search", config.DefaultSearchURL, "search engine URL")
	engine    = flag.String("engine", search.OpenSearch, "search engine implementation")
	adminURL  = flag.String("postgres", pgtest.AdminURL(), "superuser URL to create the benchmark database")
)

var quiet = benchkit.Quiet

func main() {
	flag.Parse()
	if err := run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type bench struct {
	cfg    *config.Config
	db     *pgtest.DB
	pool   *pgxpool.Pool
	nc     *nats.Conn
	js     jetstream.JetStream
	client *search.Client
	env    []string // FANOUT_ settings for the fanout processes
}

func run(ctx context.Context) error {
	cfg, err := config.Load("", nil)
	if err != nil {
		return err
	}
	suffix := strconv.FormatUint(rand.Uint64()%1_000_000_000, 36)
	cfg.Stream.Name, cfg.Stream.SubjectPrefix = "BENCHSEARCH_"+suffix, "benchsearch"+suffix
	cfg.Subscribers.DeadLetterStream, cfg.Subscribers.DeadLetterSubjectPrefix = "BENCHSEARCH_DLQ_"+suffix, "benchsearchdlq"+suffix
	cfg.Search.Engine, cfg.Search.URL, cfg.Search.Alias = *engine, *searchURL, "bench"+suffix+"-products"
	cfg.NATS.URL = *natsURL
	b := &bench{cfg: cfg}
	if b.nc, err = nats.Connect(*natsURL); err != nil {
		return fmt.Errorf("connect to nats (start the services: go tool task services): %w", err)
	}
	defer b.nc.Close()
	if b.js, err = jetstream.New(b.nc); err != nil {
		return err
	}
	if b.client, err = connect.Search(ctx, cfg.Search); err != nil {
		return err
	}
	defer b.client.Close()
	defer b.cleanup()
	if b.db, err = pgtest.Create(ctx, *adminURL); err != nil {
		return err
	}
	defer b.db.Close()
	pc, _ := pgxpool.ParseConfig(b.db.URL)
	pc.MaxConns = 16
	if b.pool, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
		return err
	}
	defer b.pool.Close()
	if err := relay.EnsureStream(ctx, b.js, cfg.Stream, 0, quiet); err != nil {
		return err
	}
	b.env = []string{
		"FANOUT_POSTGRES_URL=" + b.db.URL, "FANOUT_NATS_URL=" + *natsURL,
		"FANOUT_STREAM_NAME=" + cfg.Stream.Name, "FANOUT_STREAM_SUBJECT_PREFIX=" + cfg.Stream.SubjectPrefix,
		"FANOUT_SEARCH_ENGINE=" + *engine, "FANOUT_SEARCH_URL=" + *searchURL, "FANOUT_SEARCH_ALIAS=" + cfg.Search.Alias,
		"FANOUT_LOG_FORMAT=json",
	}

	info, _ := b.client.Info(ctx)
	fmt.Printf("search benchmark, %s, GOMAXPROCS=%d, %s %s\n\n", time.Now().Format(time.RFC3339), runtime.GOMAXPROCS(0), info.Distribution, info.Version)

	start := time.Now()
	if err := b.generate(ctx); err != nil {
		return fmt.Errorf("generate: %w", err)
	}
	fmt.Printf("setup: %d products generated in Postgres (%.1fs)\n", *products, time.Since(start).Seconds())

	if err := b.load(ctx); err != nil {
		return fmt.Errorf("bulk load: %w", err)
	}
	if err := b.steady(ctx); err != nil {
		return fmt.Errorf("steady indexing: %w", err)
	}
	return b.freshness(ctx)
}

func (b *bench) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	names, _ := b.client.Indices(ctx, b.cfg.Search.Alias+"-v*")
	for _, n := range names {
		_ = b.client.DeleteIndex(ctx, n)
	}
	_ = b.js.DeleteStream(ctx, b.cfg.Stream.Name)
	_ = b.js.DeleteStream(ctx, b.cfg.Subscribers.DeadLetterStream)
}

// generate writes the products with plain SQL (no events: the load reads
// SQL, not the stream).
func (b *bench) generate(ctx context.Context) error {
	if _, err := shop.Seed(ctx, b.pool, 1, rand.New(rand.NewPCG(1, 1))); err != nil {
		return err
	}
	if _, err := b.pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
		return err
	}
	const chunk = 100_000
	for done := 0; done < *products; done += chunk {
		n := min(chunk, *products-done)
		_, err := b.pool.Exec(ctx, `
WITH p AS (
    INSERT INTO products (sku, name, description, brand_id, category_id, price, rating, ram_gb, storage_gb)
    SELECT 'GEN-' || ($1 + g), 'Model ' || ($1 + g) || ' ' || (ARRAY['Pro','Max','Lite','Ultra','Mini'])[1 + g % 5],
           'Generated product number ' || ($1 + g) || ', with a description long enough to analyze.',
           (SELECT min(id) FROM brands) + g % 20, (SELECT min(id) FROM categories) + g % 10,
           10 + (g % 3000), (g % 51) / 10.0, 4 << (g % 4), 64 << (g % 5)
    FROM generate_series(1, $2) g
    RETURNING id)
INSERT INTO inventory (product_id, stock) SELECT id, id % 500 FROM p`, done, n)
		if err != nil {
			return err
		}
	}
	for _, table := range []string{"products", "inventory"} {
		if _, err := b.pool.Exec(ctx, "VACUUM ANALYZE "+table); err != nil {
			return err
		}
	}
	return nil
}

// load runs `fanout reindex` as its own process and reads its peak RSS.
func (b *bench) load(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "fanout-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "fanout")
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/fanout").CombinedOutput(); err != nil {
		return fmt.Errorf("build fanout: %v\n%s", err, out)
	}
	cmd := exec.CommandContext(ctx, bin, "reindex", "--loaders", strconv.Itoa(*loaders))
	cmd.Env = append(os.Environ(), b.env...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, os.Stderr // the progress bar shows on the terminal
	start := time.Now()
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("fanout reindex: %v\n%s", err, out.String())
	}
	took := time.Since(start)
	rss := cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss // KiB on Linux
	fmt.Printf("\nbulk load: %s", out.String())
	fmt.Printf("    whole command %.1fs, %.0f docs/s end to end; loader peak RSS %.0f MB (target >= 15000 docs/s, <= 200 MB)\n\n",
		took.Seconds(), float64(*products)/took.Seconds(), float64(rss)/1024)
	return nil
}

func (b *bench) publish(ctx context.Context, fill func(context.Context) error) error {
	if err := fill(ctx); err != nil {
		return err
	}
	return benchkit.Publish(ctx, b.pool, b.nc, b.cfg.Relay, b.cfg.Stream)
}

// steady measures the indexer draining a backlog of price updates.
func (b *bench) steady(ctx context.Context) error {
	err := b.publish(ctx, func(ctx context.Context) error {
		_, err := b.pool.Exec(ctx, `
WITH u AS (
    UPDATE products SET price = price + 1, version = version + 1
    WHERE id IN (SELECT (SELECT min(id) FROM products) + (g * 7919) % $2 FROM generate_series(1, $1) g)
    RETURNING id)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'product', u.id::text, 'product.updated', jsonb_build_object('product_id', u.id) FROM u, generate_series(1, $1 / (SELECT count(*) FROM u) + 1) r
LIMIT $1`, *updates, *products)
		return err
	})
	if err != nil {
		return err
	}
	fmt.Printf("steady indexing of %d live update events (batch_size %d, %d workers per instance):\n", *updates, b.cfg.Subscribers.BatchSize, b.cfg.Subscribers.Concurrency)
	var rates []float64
	for _, instances := range []int{1, 2} {
		if err := b.js.DeleteConsumer(ctx, b.cfg.Stream.Name, searchindex.Name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return err
		}
		if _, err := b.pool.Exec(ctx, `DELETE FROM processed_events`); err != nil {
			return err
		}
		var runners []*subscribers.Runner
		for range instances {
			nc, err := nats.Connect(*natsURL)
			if err != nil {
				return err
			}
			defer nc.Close()
			h := searchindex.New(b.client, b.pool, b.cfg.Search, quiet)
			r, err := subscribers.New(subscribers.Options{Handler: subscribers.Each(h), Config: b.cfg.Subscribers, Stream: b.cfg.Stream, Pool: b.pool, Conn: nc, Logger: quiet})
			if err != nil {
				return err
			}
			runners = append(runners, r)
		}
		start := time.Now()
		for _, r := range runners {
			if err := r.Start(ctx); err != nil {
				return err
			}
		}
		if err := benchkit.WaitDrained(ctx, b.js, b.cfg.Stream.Name, searchindex.Name, 15*time.Minute); err != nil {
			return err
		}
		took := time.Since(start)
		for _, r := range runners {
			_ = r.Stop(ctx)
		}
		rate := float64(*updates) / took.Seconds()
		rates = append(rates, rate)
		fmt.Printf("    %d instance(s): %.1fs, %.0f events/s\n", instances, took.Seconds(), rate)
	}
	fmt.Printf("    2 instances / 1 = %.2fx\n\n", rates[1]/rates[0])
	return nil
}

// freshness writes price updates at a steady rate with a live indexer and
// measures commit → searchable.
func (b *bench) freshness(ctx context.Context) error {
	if err := b.js.DeleteConsumer(ctx, b.cfg.Stream.Name, searchindex.Name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return err
	}
	sc := b.cfg.Subscribers
	sc.Start = "new"
	r, err := relay.New(relay.Options{Relay: b.cfg.Relay, Stream: b.cfg.Stream, Pool: b.pool, Conn: b.nc, Logger: quiet})
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	defer r.Stop(ctx) //nolint:errcheck
	sub, err := subscribers.New(subscribers.Options{Handler: subscribers.Each(searchindex.New(b.client, b.pool, b.cfg.Search, quiet)), Config: sc,
		Stream: b.cfg.Stream, Pool: b.pool, Conn: b.nc, Logger: quiet})
	if err != nil {
		return err
	}
	if err := sub.Start(ctx); err != nil {
		return err
	}
	defer sub.Stop(ctx) //nolint:errcheck

	// Each write sets a price no product has (a marker); a searcher polls
	// for the markers not yet seen.
	var mu sync.Mutex
	pending := map[int64]time.Time{} // marker price -> commit time
	var lat []time.Duration
	runCtx, cancel := context.WithTimeout(ctx, *freshFor)
	defer cancel()
	var wg sync.WaitGroup
	const writers = 8
	interval := time.Second * writers / time.Duration(*rate)
	var minID int64
	_ = b.pool.QueryRow(ctx, `SELECT min(id) FROM products`).Scan(&minID)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 11))
			next := time.Now()
			for i := 0; runCtx.Err() == nil; i++ {
				time.Sleep(time.Until(next))
				next = next.Add(interval)
				marker := int64(10_000_000 + w*1_000_000 + i)
				id := minID + rng.Int64N(int64(*products))
				err := pgx.BeginFunc(runCtx, b.pool, func(tx pgx.Tx) error {
					_, err := shop.UpdatePrice(runCtx, tx, id, marker)
					return err
				})
				if err == nil {
					mu.Lock()
					pending[marker] = time.Now()
					mu.Unlock()
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		deadline := time.Now().Add(*freshFor + 10*time.Second)
		for time.Now().Before(deadline) {
			mu.Lock()
			markers := make([]int64, 0, len(pending))
			for m := range pending {
				markers = append(markers, m)
			}
			mu.Unlock()
			if len(markers) == 0 && runCtx.Err() != nil {
				return
			}
			slices.Sort(markers)
			for chunk := range slices.Chunk(markers, 1000) {
				res, err := b.client.Search(ctx, b.cfg.Search.Alias, map[string]any{
					"size": len(chunk), "_source": []string{"price_cents"}, "track_total_hits": false,
					"query": map[string]any{"terms": map[string]any{"price_cents": chunk}},
				})
				if err != nil {
					continue
				}
				now := time.Now()
				mu.Lock()
				for _, h := range res.Hits {
					var doc struct {
						PriceCents int64 `json:"price_cents"`
					}
					if json.Unmarshal(h.Source, &doc) == nil {
						if c, ok := pending[doc.PriceCents]; ok {
							lat = append(lat, now.Sub(c))
							delete(pending, doc.PriceCents)
						}
					}
				}
				mu.Unlock()
			}
			time.Sleep(*pollEvery)
		}
	}()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if len(lat) == 0 {
		return fmt.Errorf("no write became searchable")
	}
	slices.Sort(lat)
	fmt.Printf("freshness, commit → searchable, at %d writes/s for %s (refresh_interval 1s, searcher polling every %s):\n", *rate, *freshFor, *pollEvery)
	fmt.Printf("    p50 %.0fms  p99 %.0fms  max %.0fms  (%d writes seen, %d not seen; a write overwritten by a later one before a refresh is never seen)\n",
		ms(lat[len(lat)/2]), ms(lat[len(lat)*99/100]), ms(lat[len(lat)-1]), len(lat), len(pending))
	fmt.Println("    target: p99 <= 1500ms")
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
