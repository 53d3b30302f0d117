// Command search is the search benchmark (`go tool task bench:search`). In
// one run it prints: a bulk load of 1,000,000 generated products into a new
// index by `fanout reindex` (docs/s and the loader's peak RSS); steady
// indexing of live updates with 1 and 2 indexer instances (events/s); and
// freshness, commit to searchable, p50/p99 at 500 writes/s with the default
// settings, and where its time goes, stage by stage. Each figure is measured
// -runs times (default 3), after the database is settled
// (benchkit.Settle), and printed as the median and the range of the runs.
package main

import (
	"context"
	"encoding/json"
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

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
)

var (
	products  = flag.Int("products", 1_000_000, "products to load")
	updates   = flag.Int("updates", 50_000, "live update events for the steady-indexing runs")
	rate      = flag.Int("rate", 500, "writes/s of the freshness run")
	freshFor  = flag.Duration("fresh", 20*time.Second, "how long the freshness run lasts")
	pollEvery = flag.Duration("poll", 50*time.Millisecond, "how often the freshness searcher polls")
	loaders   = flag.Int("loaders", 3, "bulk requests in flight in the loader")
	refresh   = flag.Duration("refresh-after", -1, "override search.refresh_after (0: leave visibility to the index's refresh_interval, as before it existed)")
	searchURL = flag.String("search", searchindex.DefaultURL, "search engine URL")
	engine    = flag.String("engine", search.OpenSearch, "search engine implementation")
)

var quiet = benchkit.Quiet

func main() { benchkit.Main(run) }

type bench struct {
	*benchkit.Pipeline
	client *search.Client
	env    []string // FANOUT_ settings for the fanout processes
}

func run(ctx context.Context) error {
	p, err := benchkit.Open(ctx, "SEARCH", 16)
	if err != nil {
		return err
	}
	defer p.Close()
	cfg := p.Config
	cfg.Search.Engine, cfg.Search.URL, cfg.Search.Alias = *engine, *searchURL, "bench"+p.Suffix+"-products"
	if *refresh >= 0 {
		cfg.Search.RefreshAfter = *refresh
	}
	b := &bench{Pipeline: p}
	if b.client, err = search.Connect(ctx, cfg.Search.Client()); err != nil {
		return err
	}
	defer b.client.Close()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = b.dropIndices(ctx, "")
	}()
	if err := stream.Ensure(ctx, b.JS, cfg.Stream, 0, quiet); err != nil {
		return err
	}
	b.env = []string{
		"FANOUT_POSTGRES_URL=" + b.DB.URL, "FANOUT_NATS_URL=" + *benchkit.NATSURL,
		"FANOUT_STREAM_NAME=" + cfg.Stream.Name, "FANOUT_STREAM_SUBJECT_PREFIX=" + cfg.Stream.SubjectPrefix,
		"FANOUT_SEARCH_ENGINE=" + *engine, "FANOUT_SEARCH_URL=" + *searchURL, "FANOUT_SEARCH_ALIAS=" + cfg.Search.Alias,
		"FANOUT_LOG_FORMAT=json", "FANOUT_SEARCH_REFRESH_AFTER=" + cfg.Search.RefreshAfter.String(),
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

// generate writes the products with plain SQL (no events: the load reads
// SQL, not the stream).
func (b *bench) generate(ctx context.Context) error {
	if _, err := shop.Seed(ctx, b.Pool, 1, rand.New(rand.NewPCG(1, 1))); err != nil {
		return err
	}
	if _, err := b.Pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
		return err
	}
	const chunk = 100_000
	for done := 0; done < *products; done += chunk {
		n := min(chunk, *products-done)
		_, err := b.Pool.Exec(ctx, `
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
	return benchkit.Settle(ctx, b.Pool)
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
	fmt.Printf("bulk load of %d products by `fanout reindex --loaders %d` (a new index each run):\n", *products, *loaders)
	var rate, rssMB benchkit.Figure
	for run := range *benchkit.Runs {
		cmd := exec.CommandContext(ctx, bin, "reindex", "--loaders", strconv.Itoa(*loaders))
		cmd.Env = append(os.Environ(), b.env...)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, os.Stderr // the progress shows as it goes
		start := time.Now()
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("fanout reindex: %v\n%s", err, out.String())
		}
		took := time.Since(start)
		rss := cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss // KiB on Linux
		rate.Add(float64(*products) / took.Seconds())
		rssMB.Add(float64(rss) / 1024)
		fmt.Printf("    run %d of %d: %.1fs, %.0f docs/s end to end, peak RSS %.0f MB; reindex said: %s", run+1, *benchkit.Runs, took.Seconds(),
			float64(*products)/took.Seconds(), float64(rss)/1024, out.String())
		// A reindex keeps the index before its own: runs must not pile up
		// millions of documents.
		cur, err := searchindex.Current(ctx, b.client, b.Config.Search.Alias)
		if err != nil {
			return err
		}
		if err := b.dropIndices(ctx, cur); err != nil {
			return err
		}
	}
	fmt.Printf("    %s end to end; loader peak RSS %s (target >= 15000 docs/s, <= 200 MB)\n\n", rate.Format("%.0f docs/s"), rssMB.Format("%.0f MB"))
	return nil
}

// dropIndices deletes the indices the runs made, but keep.
func (b *bench) dropIndices(ctx context.Context, keep string) error {
	names, err := b.client.Indices(ctx, b.Config.Search.Alias+"-v*")
	if err != nil {
		return err
	}
	for _, n := range names {
		if n != keep {
			if err := b.client.DeleteIndex(ctx, n); err != nil {
				return err
			}
		}
	}
	return nil
}

// steady measures the indexer draining a backlog of price updates.
func (b *bench) steady(ctx context.Context) error {
	_, err := b.Pool.Exec(ctx, `
WITH u AS (
    UPDATE products SET price = price + 1, version = version + 1
    WHERE id IN (SELECT (SELECT min(id) FROM products) + (g * 7919) % $2 FROM generate_series(1, $1) g)
    RETURNING id)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'product', u.id::text, 'product.updated', jsonb_build_object('product_id', u.id) FROM u, generate_series(1, $1 / (SELECT count(*) FROM u) + 1) r
LIMIT $1`, *updates, *products)
	if err != nil {
		return err
	}
	if err := b.Publish(ctx); err != nil {
		return err
	}
	fmt.Printf("steady indexing of %d live update events (batch_size %d, %d workers per instance):\n", *updates, b.Config.Subscribers.BatchSize, b.Config.Subscribers.Concurrency)
	// A first pass, not counted: the first one after the bulk load read a
	// quarter of the next ones' rate even on a settled database (the
	// engine still busy with the loads' segments).
	warm, err := b.steadyRun(ctx, 1)
	if err != nil {
		return err
	}
	fmt.Printf("    warm-up pass (not counted): 1 instance %.0f events/s\n", warm)
	instances := []int{1, 2}
	rates := make([]benchkit.Figure, len(instances))
	var twoOverOne benchkit.Figure
	for round := range *benchkit.Runs {
		got := make([]float64, len(instances))
		for _, i := range benchkit.Rotation(round, len(instances)) {
			rate, err := b.steadyRun(ctx, instances[i])
			if err != nil {
				return err
			}
			got[i] = rate
			rates[i].Add(rate)
		}
		twoOverOne.Add(got[1] / got[0])
		fmt.Printf("    round %d of %d: 1 instance %.0f, 2 instances %.0f events/s\n", round+1, *benchkit.Runs, got[0], got[1])
	}
	for i, n := range instances {
		fmt.Printf("    %d instance(s): %s\n", n, rates[i].Format("%.0f events/s"))
	}
	fmt.Printf("    2 instances / 1 = %s\n\n", twoOverOne.Format("%.2fx"))
	return nil
}

// steadyRun has instances indexers drain the whole stream from its start
// and returns events/s.
func (b *bench) steadyRun(ctx context.Context, instances int) (float64, error) {
	// Settled, then emptied: a checkpoint analyzed while empty would be
	// read with a plan for an empty table until autovacuum (a minute apart)
	// analyzes it again (benchkit's Reset).
	if err := b.Reset(ctx, searchindex.Name, "processed_events"); err != nil {
		return 0, err
	}
	opts := subscribers.Options{Declaration: searchindex.Subscriber, Config: b.Config.Subscribers}
	took, err := b.TimeDrain(ctx, instances, opts, func() subscribers.Handler {
		return subscribers.Each(searchindex.New(b.client, b.Pool, b.Config.Search, quiet))
	})
	if err != nil {
		return 0, err
	}
	return float64(*updates) / took.Seconds(), nil
}

// freshness measures commit → searchable, -runs times, and where the time
// goes stage by stage.
func (b *bench) freshness(ctx context.Context) error {
	fmt.Printf("freshness, commit → searchable, at %d writes/s for %s (search.refresh_after %s, searcher polling every %s), %d runs:\n",
		*rate, *freshFor, b.Config.Search.RefreshAfter, *pollEvery, *benchkit.Runs)
	var p50, p99, maxLat benchkit.Figure
	stageP50 := map[string]*benchkit.Figure{}
	stageP99 := map[string]*benchkit.Figure{}
	for run := range *benchkit.Runs {
		res, err := b.freshnessRun(ctx, run)
		if err != nil {
			return err
		}
		p50.Add(benchkit.Ms(res.P50))
		p99.Add(benchkit.Ms(res.P99))
		maxLat.Add(benchkit.Ms(res.Max))
		fmt.Printf("    run %d of %d: p50 %.0fms  p99 %.0fms  max %.0fms  (%d writes seen, %d not seen: overwritten by a later write before it was searchable)\n",
			run+1, *benchkit.Runs, benchkit.Ms(res.P50), benchkit.Ms(res.P99), benchkit.Ms(res.Max), res.N, res.unseen)
		for _, w := range res.stages {
			if stageP50[w.Stage] == nil {
				stageP50[w.Stage], stageP99[w.Stage] = &benchkit.Figure{}, &benchkit.Figure{}
			}
			stageP50[w.Stage].Add(1000 * w.Quantile(0.5))
			stageP99[w.Stage].Add(1000 * w.Quantile(0.99))
		}
	}
	fmt.Printf("    commit → searchable: p50 %s  p99 %s  max %s\n", p50.Format("%.0fms"), p99.Format("%.0fms"), maxLat.Format("%.0fms"))
	fmt.Println("    by stage (fanout_stage_seconds; the searcher's poll adds up to its interval on top):")
	for _, stage := range metrics.Stages {
		if stageP50[stage] != nil {
			fmt.Printf("        %-22s p50 %s  p99 %s\n", stage, stageP50[stage].Format("%.1fms"), stageP99[stage].Format("%.1fms"))
		}
	}
	fmt.Println("    target: p99 <= 1500ms")
	return nil
}

type freshnessResult struct {
	benchkit.Latencies
	unseen int
	stages []metrics.StageWindow
}

// freshnessRun writes price updates at a steady rate with a live relay and
// indexer, polls the index for each write, and reads the stage latencies
// the pipeline recorded meanwhile.
func (b *bench) freshnessRun(ctx context.Context, run int) (freshnessResult, error) {
	var res freshnessResult
	if err := b.Reset(ctx, searchindex.Name); err != nil {
		return res, err
	}
	reg := prometheus.NewRegistry()
	stages := metrics.StagesOf(reg)
	r, err := b.StartRelay(ctx, relay.NewMetrics(reg))
	if err != nil {
		return res, err
	}
	defer r.Stop(ctx) //nolint:errcheck
	if err := b.catchUp(ctx); err != nil {
		return res, err
	}
	indexer := searchindex.New(b.client, b.Pool, b.Config.Search, quiet)
	indexer.ObserveSearchable(func(took []time.Duration) { stages.Observe(metrics.StageSearchable, searchindex.Name, took...) })
	sub, err := b.StartRunner(ctx, subscribers.Options{Declaration: searchindex.Subscriber, Handler: subscribers.Each(indexer),
		Config: b.Config.Subscribers, Observer: subscribers.NewMetrics(reg)})
	if err != nil {
		return res, err
	}
	defer sub.Stop(ctx) //nolint:errcheck

	// Each write sets a price no product has (a marker); a searcher polls
	// for the markers not yet seen.
	pending := benchkit.NewPending() // marker price -> commit
	writing, cancel := context.WithTimeout(ctx, *freshFor)
	defer cancel()
	var minID int64
	_ = b.Pool.QueryRow(ctx, `SELECT min(id) FROM products`).Scan(&minID)
	const writers = 8
	var wg sync.WaitGroup
	wg.Go(func() {
		benchkit.Pace{Workers: writers, Rate: *rate, Seed: 11}.Run(writing, func(w, i int, rng *rand.Rand) {
			marker := int64(10_000_000 + (run*writers+w)*1_000_000 + i) // no run sees an earlier run's markers
			id := minID + rng.Int64N(int64(*products))
			err := pgx.BeginFunc(writing, b.Pool, func(tx pgx.Tx) error {
				_, err := shop.UpdatePrice(writing, tx, id, marker)
				return err
			})
			if err == nil {
				pending.Committed(marker)
			}
		})
	})
	wg.Go(func() { b.searchMarkers(ctx, writing, pending) })
	wg.Wait()
	lat := pending.Take()
	if len(lat) == 0 {
		return res, fmt.Errorf("no write became searchable")
	}
	res.Latencies, res.unseen = benchkit.Quantiles(lat), pending.Unseen()
	res.stages = stages.LastMinute()
	return res, nil
}

// catchUp runs the indexer until its consumer, made again by Reset, has
// caught up, and says how long that took. The indexer has checkpoints
// from the steady-indexing part, so its new consumer starts at the
// stream's first event, as any subscriber with checkpoints does
// (subscribers.start applies to a new subscriber only): the events it
// replays are skipped as processed, but a measurement begun before they
// are would time the live events queued behind them (seconds after the
// 100,000 updates of the steady part), not freshness.
func (b *bench) catchUp(ctx context.Context) error {
	began := time.Now()
	sub, err := b.StartRunner(ctx, subscribers.Options{Declaration: searchindex.Subscriber,
		Handler: subscribers.Each(searchindex.New(b.client, b.Pool, b.Config.Search, quiet)), Config: b.Config.Subscribers})
	if err != nil {
		return err
	}
	err = b.WaitDrained(ctx, searchindex.Name, 10*time.Minute)
	if stopErr := sub.Stop(ctx); err == nil {
		err = stopErr
	}
	if err != nil {
		return fmt.Errorf("the indexer's new consumer catching up before the run: %w", err)
	}
	fmt.Printf("    (the indexer's consumer, made again, replayed the stream to its end first: %.1fs, not measured)\n", time.Since(began).Seconds())
	return nil
}

// searchMarkers polls the index for the pending markers every -poll until
// none is left once writing has ended, for -fresh and 10 s at most.
func (b *bench) searchMarkers(ctx, writing context.Context, pending *benchkit.Pending) {
	for deadline := time.Now().Add(*freshFor + 10*time.Second); time.Now().Before(deadline); time.Sleep(*pollEvery) {
		markers := pending.Keys()
		if len(markers) == 0 && writing.Err() != nil {
			return
		}
		for chunk := range slices.Chunk(markers, 1000) {
			found, err := b.client.Search(ctx, b.Config.Search.Alias, map[string]any{
				"size": len(chunk), "_source": []string{"price_cents"}, "track_total_hits": false,
				"query": map[string]any{"terms": map[string]any{"price_cents": chunk}},
			})
			if err != nil {
				continue
			}
			now := time.Now()
			var seen []int64
			for _, h := range found.Hits {
				var doc struct {
					PriceCents int64 `json:"price_cents"`
				}
				if json.Unmarshal(h.Source, &doc) == nil {
					seen = append(seen, doc.PriceCents)
				}
			}
			pending.Seen(now, seen...)
		}
	}
}
