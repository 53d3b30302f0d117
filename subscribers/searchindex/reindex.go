package searchindex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fanout/fanout/schema"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// Reindexer builds a new index version from SQL and swaps the alias to it
// without losing an update or a search.
type Reindexer struct {
	Client *search.Client
	Pool   *pgxpool.Pool
	JS     jetstream.JetStream
	Stream stream.Config
	Search Config
	Logger *slog.Logger
	// Progress receives the load's progress (nil: none): a bar on a
	// terminal, plain lines elsewhere.
	Progress io.Writer
	// Loaders is how many bulk requests are in flight during the load.
	Loaders int
	// PageSize is how many products the load reads per statement (0:
	// productPage). Each page is a short statement in the load's snapshot.
	PageSize int
}

// Failure is a document the engine refused.
type Failure struct {
	ID     string
	Type   string
	Reason string
}

// ReindexReport says what a reindex did.
type ReindexReport struct {
	From, To   string
	Snapshot   int64 // products in the SQL snapshot the load read
	Loaded     int64 // documents the new index accepted
	Failures   []Failure
	Replayed   int // events replayed onto the new index after the load
	LoadTime   time.Duration
	TotalTime  time.Duration
	DocsPerSec float64
}

// ErrTooManyFailures aborts a reindex before the swap.
var ErrTooManyFailures = errors.New("too many documents failed")

// Reindex creates <alias>-v<N+1> from the mapping in schema/, bulk-loads it
// from one SQL snapshot (streamed: memory stays bounded), replays the events
// that arrived meanwhile, verifies it, swaps the alias in one _aliases call
// and replays once more. The old index is kept (Rollback returns to it).
//
// No update is lost: the stream position is recorded before the snapshot
// is taken, so every change the snapshot missed has an event after that
// position, and those events are applied to the new index (documents are
// read from SQL and written with external versions, so applying an event
// twice, or one the snapshot already saw, is harmless). Events handled by
// the live indexer just before the swap still went to the old index; the
// replay after the swap covers them.
func (r *Reindexer) Reindex(ctx context.Context) (ReindexReport, error) {
	start := time.Now()
	alias := r.Search.Alias
	from, versions, err := indices(ctx, r.Client, alias)
	rep := ReindexReport{From: from}
	if err != nil {
		return rep, err
	}
	next := 1
	if len(versions) > 0 {
		next = indexVersion(alias, versions[len(versions)-1]) + 1
	}
	rep.To = IndexName(alias, next)

	// 1. The stream position, before the snapshot.
	mark, err := r.streamLastSeq(ctx)
	if err != nil {
		return rep, err
	}

	// 2. The new index, refresh off during the load.
	body, refresh, err := loadSettings()
	if err != nil {
		return rep, err
	}
	if err := r.Client.CreateIndex(ctx, rep.To, body); err != nil {
		return rep, fmt.Errorf("create %s: %w", rep.To, err)
	}
	r.Logger.Info("reindex: loading", "from", rep.From, "to", rep.To, "stream_seq", mark)

	// 3. The load.
	if err := r.fill(ctx, &rep, refresh); err != nil {
		return rep, r.abandon(rep, err)
	}

	// 4. Catch up with what happened during the load, and verify.
	n, mark, err := r.replay(ctx, rep.To, mark)
	rep.Replayed += n
	if err == nil {
		n, mark, err = r.verify(ctx, rep.To, mark, rep.Failures)
		rep.Replayed += n
	}
	if err != nil {
		return rep, r.abandon(rep, err)
	}

	// 5. The swap, atomic, then the events that raced it.
	if err := r.Client.SwapAlias(ctx, alias, rep.To); err != nil {
		return rep, fmt.Errorf("swap alias %s to %s: %w", alias, rep.To, err)
	}
	n, _, err = r.replay(ctx, rep.To, mark)
	rep.Replayed += n
	rep.TotalTime = time.Since(start)
	if err != nil {
		return rep, fmt.Errorf("swapped to %s, but the replay after the swap failed (run `fanout reindex --check --repair`): %w", rep.To, err)
	}
	r.Logger.Info("reindex: swapped", "alias", alias, "from", rep.From, "to", rep.To, "docs", rep.Loaded,
		"replayed_events", rep.Replayed, "took", rep.TotalTime)
	return rep, nil
}

// fill loads the new index (rep.To) from SQL and makes it searchable
// (its refresh interval back to refresh), with the load's figures in rep;
// more failed documents than search.reindex_max_failures fail it.
func (r *Reindexer) fill(ctx context.Context, rep *ReindexReport, refresh string) error {
	loadStart := time.Now()
	snapshot, loaded, failures, err := r.load(ctx, rep.To)
	rep.Snapshot, rep.Loaded, rep.Failures, rep.LoadTime = snapshot, loaded, failures, time.Since(loadStart)
	if rep.LoadTime > 0 {
		rep.DocsPerSec = float64(loaded) / rep.LoadTime.Seconds()
	}
	if err == nil {
		err = r.Client.SetRefreshInterval(ctx, rep.To, refresh)
	}
	if err == nil {
		err = r.Client.Refresh(ctx, rep.To)
	}
	if err == nil && len(failures) > r.Search.ReindexMaxFailures {
		err = fmt.Errorf("%w: %d of %d documents (search.reindex_max_failures is %d); first: %s",
			ErrTooManyFailures, len(failures), loaded+int64(len(failures)), r.Search.ReindexMaxFailures, describe(failures, 10, sayFailure))
	}
	return err
}

// loadSettings is the mapping with refresh disabled, and the refresh
// interval to restore after the load.
func loadSettings() (body []byte, refresh string, err error) {
	var def map[string]any
	if err := json.Unmarshal(schema.ProductIndex, &def); err != nil {
		return nil, "", err
	}
	settings, _ := def["settings"].(map[string]any)
	refresh, _ = settings["refresh_interval"].(string)
	if refresh == "" {
		refresh = "1s"
	}
	settings["refresh_interval"] = "-1"
	body, err = json.Marshal(def)
	return body, refresh, err
}

// abandon deletes the new index of a reindex that failed (err) before the
// swap, and says so.
func (r *Reindexer) abandon(rep ReindexReport, err error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := r.Client.DeleteIndex(ctx, rep.To); err != nil {
		r.Logger.Warn("delete abandoned index", "index", rep.To, "error", err)
	}
	return fmt.Errorf("reindex into %s aborted before the swap (the alias still points at %q; %s deleted): %w", rep.To, rep.From, rep.To, err)
}

func (r *Reindexer) streamLastSeq(ctx context.Context) (uint64, error) {
	s, err := r.JS.Stream(ctx, r.Stream.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		// No stream yet (a fresh installation): no event to replay.
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", r.Stream.Name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", r.Stream.Name, err)
	}
	return info.State.LastSeq, nil
}

// load streams every product from one snapshot into index, with Loaders
// bulk requests in flight. It returns how many products the snapshot held
// and how many of them the index accepted.
func (r *Reindexer) load(ctx context.Context, index string) (total, loaded int64, failures []Failure, err error) {
	tx, err := r.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return 0, 0, nil, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // read-only
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM products`).Scan(&total); err != nil {
		return 0, 0, nil, err
	}
	bar := newProgress(r.Progress, total)

	loaders := max(r.Loaders, 1)
	batches := make(chan []search.Op, loaders)
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	for range loaders {
		g.Go(func() error {
			for ops := range batches {
				results, err := r.Client.Bulk(gctx, index, ops)
				if err != nil {
					return err
				}
				var ok int64
				mu.Lock()
				for _, res := range results {
					if res.Status < 300 || res.Status == 409 {
						ok++
					} else {
						failures = append(failures, Failure{ID: res.ID, Type: res.Type, Reason: fmt.Sprintf("%d: %s", res.Status, res.Reason)})
					}
				}
				loaded += ok
				mu.Unlock()
				bar.add(len(ops))
			}
			return nil
		})
	}
	g.Go(func() error {
		defer close(batches)
		// Pages of the snapshot: memory holds one page and one batch per
		// loader.
		page := r.PageSize
		if page <= 0 {
			page = productPage
		}
		return shop.ProductPages(gctx, tx, page, func(page []shop.Product) error {
			for chunk := range slices.Chunk(page, r.Search.BulkSize) {
				ops := make([]search.Op, 0, len(chunk))
				for _, p := range chunk {
					doc, err := Document(p)
					if err != nil {
						return err
					}
					ops = append(ops, search.Op{ID: strconv.FormatInt(p.ID, 10), Version: p.Version, Doc: doc})
				}
				select {
				case batches <- ops:
				case <-gctx.Done():
					return gctx.Err()
				}
			}
			return nil
		})
	})
	err = g.Wait()
	bar.finish()
	return total, loaded, failures, err
}

// replay applies the product, brand and category events after seq (up to
// the stream's end as of now) to index, and returns how many it read and
// the new position.
func (r *Reindexer) replay(ctx context.Context, index string, seq uint64) (int, uint64, error) {
	last, err := r.streamLastSeq(ctx)
	if err != nil || last <= seq {
		return 0, seq, err
	}
	h := &Handler{syncer: syncer{client: r.Client, pool: r.Pool, bulkSize: r.Search.BulkSize, logger: r.Logger,
		retryWaits: []time.Duration{200 * time.Millisecond, time.Second, 3 * time.Second}}, alias: index}
	read, pos, err := ReadEvents(ctx, r.JS, r.Stream, seq, last, func(evs []subscribers.Event) error {
		for i, err := range h.HandleBatch(ctx, evs) {
			if err != nil && !subscribers.IsPermanent(err) {
				return fmt.Errorf("replay event %d (seq %d): %w", evs[i].ID, evs[i].StreamSeq, err)
			}
		}
		return nil
	})
	if err != nil {
		return read, seq, err
	}
	// Past the last product event read, the stream up to last held none.
	return read, max(pos, last), nil
}

// verify compares the new index with SQL before the swap: a sample of
// documents field by field and version by version, and the counts. Writes
// keep coming meanwhile, so a document may be behind only because its event
// has not been replayed yet: the drifted ones are re-checked after another
// replay, a few times; one that is still wrong after that is real drift. A
// product that changes faster than a round (a bestseller's stock) may be
// behind SQL at every check: it passes once a replay has brought its
// document to at least the version SQL had before that replay, which is
// what a working replay guarantees. The counts get a tolerance of 1%
// (creates and deletes in flight); `fanout reindex --check` compares every
// document exactly, at rest.
//
// Documents the engine refused during the load (within
// search.reindex_max_failures) are known and reported; they are not drift.
func (r *Reindexer) verify(ctx context.Context, index string, mark uint64, failures []Failure) (int, uint64, error) {
	const rounds = 6
	replayed := 0
	refused := make(map[int64]bool, len(failures))
	for _, f := range failures {
		if id, err := strconv.ParseInt(f.ID, 10, 64); err == nil {
			refused[id] = true
		}
	}
	known := func(d Drift) Drift {
		d.Missing = slices.DeleteFunc(d.Missing, func(id int64) bool { return refused[id] })
		return d
	}
	if err := r.Client.Refresh(ctx, index); err != nil {
		return 0, mark, err
	}
	drift, err := Check(ctx, r.Client, r.Pool, index, 500)
	if err != nil {
		return 0, mark, err
	}
	// seen is the SQL version of each differing product at the check
	// before the last replay.
	var seen map[int64]versionPair
	for round := 1; ; round++ {
		drift = known(drift)
		drift.Different = slices.DeleteFunc(drift.Different, func(id int64) bool {
			before, was := seen[id]
			now, is := drift.versions[id]
			return was && is && now.index < now.sql && now.index >= before.sql
		})
		seen = drift.versions
		off := drift.SQLCount - drift.IndexCount - int64(len(refused))
		countOK := off <= max(10, drift.SQLCount/100) && -off <= max(10, drift.SQLCount/100)
		if len(drift.IDs()) == 0 && countOK {
			return replayed, mark, nil
		}
		if round == rounds {
			return replayed, mark, fmt.Errorf("verification failed: %s", drift)
		}
		r.Logger.Info("reindex: verification found drift, catching up", "drift", drift.String())
		time.Sleep(300 * time.Millisecond)
		n, next, err := r.replay(ctx, index, mark)
		replayed += n
		mark = next
		if err != nil {
			return replayed, mark, err
		}
		if err := r.Client.Refresh(ctx, index); err != nil {
			return replayed, mark, err
		}
		recheck := Drift{}
		if err := r.Pool.QueryRow(ctx, `SELECT count(*) FROM products`).Scan(&recheck.SQLCount); err != nil {
			return replayed, mark, err
		}
		if recheck.IndexCount, err = r.Client.Count(ctx, index); err != nil {
			return replayed, mark, err
		}
		if drift, err = CheckIDs(ctx, r.Client, r.Pool, index, drift.IDs(), recheck); err != nil {
			return replayed, mark, err
		}
	}
}

// describe lists the first n of xs, each as say puts it, and counts the
// rest.
func describe[T any](xs []T, n int, say func(T) string) string {
	var parts []string
	for i, x := range xs {
		if i == n {
			parts = append(parts, fmt.Sprintf("and %d more", len(xs)-n))
			break
		}
		parts = append(parts, say(x))
	}
	return strings.Join(parts, "; ")
}

func sayFailure(f Failure) string { return fmt.Sprintf("document %s: %s %s", f.ID, f.Type, f.Reason) }
