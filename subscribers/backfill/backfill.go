// Package backfill lets a subscriber start from Postgres's current state,
// not only from what the stream still holds (DESIGN.md, invariant 12).
// Its declaration names the table its state derives from and how a row
// becomes an event its handler understands (subscribers.Backfill); `fanout
// backfill` runs Run, which reads the table in key order, in chunks, and
// hands each chunk to the handler, with a checkpoint that commits with the
// chunk's effects.
//
// # Merging with live events
//
// A backfill event names its row (a key in its payload) and nothing of the
// row's state. The handler derives the state from Postgres when it applies
// the event, and writes it only over an older version of it (a version
// column the writers bump, such as products.version, or a state that is
// created once, such as an order's invoice). A live event and a backfill
// event of the same row may then apply in either order, and either may
// apply again: the effect ends at the row's latest state, never an older
// one. This is the version-based alternative to the watermarks of
// incremental snapshots (DBLog, Debezium): those close the window between
// reading a row and applying it by holding back the chunk until the log
// passes a watermark; here the handler reads the row at apply time, and
// the version closes the race between two appliers.
//
// # How it runs
//
// The key range is split into segments read side by side, a worker each
// (segment.go); a worker reads its next chunk while the current one
// applies. A chunk is handed to the handler with the verdicts, outages
// and dead letters of the live runtime (its subscribers.Health), and its
// segment's checkpoint (subscriber_backfill_segments.last_key) commits
// with a TxHandler's effects (chunk.go). Its progress is in the
// bookkeeping store's subscriber_backfills.
package backfill

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Options are a backfill's collaborators and settings.
type Options struct {
	Declaration subscribers.Declaration
	// Handler is the declaration's handler, built (Declaration.Build).
	Handler subscribers.Handler
	// Config gives max_failures, retry_min, retry_max and handler_timeout.
	Config subscribers.Config
	Pool   *pgxpool.Pool
	Logger *slog.Logger
	// Where filters the rows (an SQL condition over the table, alias t);
	// a backfill resumed keeps the one it started with.
	Where string
	// Rate limits the rows handled per second, all workers together; 0
	// is no limit.
	Rate float64
	// Chunk is the rows per chunk (one transaction): DefaultChunk when 0.
	Chunk int
	// Workers is how many segments of the key range are read side by
	// side, each by its own worker: DefaultWorkers when 0. More go faster
	// on a machine with cores to spare, and take them from the live events
	// on one without (docs/benchmarks.md, "Backfill"). A backfill resumed
	// keeps the segments it started with.
	Workers int
	// Restart starts over, whether the last backfill is unfinished or
	// finished (which is otherwise not run again).
	Restart bool
	// Progress, if set, is called after every chunk and while paused,
	// from one worker at a time.
	Progress func(Status)
	// Hooks are for tests.
	Hooks Hooks
}

// Hooks break or pace a backfill in tests.
type Hooks struct {
	// AfterRead runs after a chunk is read, before it is handled.
	AfterRead func(keys []int64)
	// CheckpointApart commits a chunk's effects and its checkpoint in two
	// transactions this far apart: the flaw the kill test must catch.
	CheckpointApart time.Duration
}

// Status is a backfill's row in subscriber_backfills.
type Status = bookkeeping.BackfillStatus

// The defaults of Options.Workers and Chunk, and of `fanout backfill
// --workers` and `--chunk`: the fastest measured beside live writers on
// two cores, with their freshness p99 within 2x on the medians
// (docs/benchmarks.md, "Backfill").
const (
	DefaultWorkers = 2
	DefaultChunk   = 1000
)

// ErrWhere is wrapped by the error of a backfill whose --where differs
// from the one its unfinished backfill started with.
var ErrWhere = errors.New("an unfinished backfill has another --where")

// Run runs the declaration's backfill until it has handled every row it
// has to, or ctx ends (it resumes from its last chunks when run again).
// While a dependency is down it waits; only the handler's verdict on a row
// makes it a failure (subscriber_backfill_failures).
func Run(ctx context.Context, opts Options) (Status, error) {
	d := opts.Declaration
	if d.Backfill == nil {
		return Status{}, fmt.Errorf("subscriber %s declares no backfill (Declaration.Backfill)", d.Name)
	}
	if opts.Handler.IsZero() {
		return Status{}, fmt.Errorf("subscriber %s: no handler", d.Name)
	}
	b := newBackfiller(opts)
	hctx, stopProbes := context.WithCancel(ctx)
	deps := append([]subscribers.Dependency{{Name: subscribers.DependencyPostgres, Probe: opts.Pool.Ping}}, opts.Handler.Dependencies()...)
	health := subscribers.NewHealth(hctx, d.Name, b.logger, subscribers.NopObserver{}, deps)
	b.health = health
	defer func() {
		stopProbes()
		health.Wait()
	}()
	segments, err := b.begin(ctx)
	if err != nil {
		return b.status, err
	}
	if b.status.Finished() {
		return b.status, nil
	}
	b.where = b.status.Where
	return b.run(ctx, segments)
}

// List returns every subscriber's backfill, running or finished (fanout
// status).
func List(ctx context.Context, db bookkeeping.DB) ([]Status, error) {
	bs, err := bookkeeping.New(db).BackfillList(ctx)
	if err != nil {
		return nil, fmt.Errorf("read subscriber_backfills: %w", err)
	}
	return bs, nil
}

// Pause pauses (or resumes) subscriber's unfinished backfill: the process
// running it stops between chunks until it is resumed. Once a pause
// returns, no chunk is applied: a chunk in flight is rolled back and done
// again on resume.
func Pause(ctx context.Context, pool *pgxpool.Pool, subscriber string, paused bool) error {
	ok, err := bookkeeping.New(pool).BackfillPause(ctx, bookkeeping.BackfillPauseParams{Subscriber: subscriber, Paused: paused})
	if err != nil {
		return fmt.Errorf("pause the backfill of %s: %w", subscriber, err)
	}
	if !ok {
		return fmt.Errorf("subscriber %s has no unfinished backfill", subscriber)
	}
	return nil
}
