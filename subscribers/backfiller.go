package subscribers

// The backfill's runtime: chunks read in key order, segments of the key
// range side by side, handed to the handler with the verdicts, outages and
// dead letters of the live runtime, and a checkpoint per segment
// (subscriber_backfill_segments.last_key) that commits with a TxHandler's
// effects.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"
)

// BackfillOptions are a backfill's collaborators and settings.
type BackfillOptions struct {
	Declaration Declaration
	// Handler is the declaration's handler, built (Declaration.Build).
	Handler Handler
	// Config gives max_failures, retry_min, retry_max and handler_timeout.
	Config Config
	Pool   *pgxpool.Pool
	Logger *slog.Logger
	// Where filters the rows (an SQL condition over the table, alias t);
	// a backfill resumed keeps the one it started with.
	Where string
	// Rate limits the rows handled per second, all workers together; 0
	// is no limit.
	Rate float64
	// Chunk is the rows per chunk (one transaction):
	// DefaultBackfillChunk when 0.
	Chunk int
	// Workers is how many segments of the key range are read side by
	// side, each by its own worker: DefaultBackfillWorkers when 0. More
	// go faster on a machine with cores to spare, and take them from the
	// live events on one without (docs/benchmarks.md, "Backfill"). A
	// backfill resumed keeps the segments it started with.
	Workers int
	// Restart starts over, whether the last backfill is unfinished or
	// finished (which is otherwise not run again).
	Restart bool
	// Progress, if set, is called after every chunk and while paused,
	// from one worker at a time.
	Progress func(BackfillStatus)
	// Hooks are for tests.
	Hooks BackfillHooks
}

// BackfillHooks break or pace a backfill in tests.
type BackfillHooks struct {
	// AfterRead runs after a chunk is read, before it is handled.
	AfterRead func(keys []int64)
	// CheckpointApart commits a chunk's effects and its checkpoint in two
	// transactions this far apart: the flaw the kill test must catch.
	CheckpointApart time.Duration
}

// BackfillStatus is a backfill's row in subscriber_backfills.
type BackfillStatus struct {
	Subscriber string
	Where      string
	HighKey    int64
	Total      int64
	Done       int64
	Failed     int64
	Paused     bool
	StartedAt  time.Time
	UpdatedAt  time.Time
	FinishedAt *time.Time
	// Segments are the key range's parts read side by side, SegmentsDone
	// those finished.
	Segments, SegmentsDone int
}

// Finished reports whether the backfill has done its last chunk.
func (s BackfillStatus) Finished() bool { return s.FinishedAt != nil }

// The defaults of BackfillOptions.Workers and Chunk, and of `fanout
// backfill --workers` and `--chunk`: the fastest measured beside live
// writers on two cores, with their freshness p99 within 2x on the medians
// (docs/benchmarks.md, "Backfill").
const (
	DefaultBackfillWorkers = 2
	DefaultBackfillChunk   = 1000
)

// ErrBackfillWhere is wrapped by the error of a backfill whose --where
// differs from the one its unfinished backfill started with.
var ErrBackfillWhere = errors.New("an unfinished backfill has another --where")

const (
	backfillStatusSQL = `SELECT b.subscriber, b.where_sql, b.high_key, b.total_rows, b.done_rows, b.failed_rows, b.paused,
       b.started_at, b.updated_at, b.finished_at,
       (SELECT count(*) FROM subscriber_backfill_segments s WHERE s.subscriber = b.subscriber),
       (SELECT count(*) FROM subscriber_backfill_segments s WHERE s.subscriber = b.subscriber AND s.last_key >= s.to_key)
FROM subscriber_backfills b`

	startBackfillSQL = `
INSERT INTO subscriber_backfills AS b (subscriber, where_sql, high_key, total_rows)
VALUES ($1, $2, $3, $4)
ON CONFLICT (subscriber) DO UPDATE
SET where_sql = excluded.where_sql, high_key = excluded.high_key, total_rows = excluded.total_rows,
    done_rows = 0, failed_rows = 0, paused = false, started_at = now(), updated_at = now(), finished_at = NULL`

	clearSegmentsSQL = `DELETE FROM subscriber_backfill_segments WHERE subscriber = $1`

	addSegmentSQL = `INSERT INTO subscriber_backfill_segments (subscriber, segment, from_key, to_key, last_key) VALUES ($1, $2, $3, $4, $3)`

	segmentsSQL = `SELECT segment, to_key, last_key FROM subscriber_backfill_segments WHERE subscriber = $1 ORDER BY segment`

	clearBackfillFailuresSQL = `DELETE FROM subscriber_backfill_failures WHERE subscriber = $1`

	// lockSegmentSQL fences a chunk: another process running the same
	// backfill, or a restart, moved the segment on if last_key or
	// started_at differ.
	lockSegmentSQL = `
SELECT s.last_key, b.started_at, b.paused
FROM subscriber_backfill_segments s JOIN subscriber_backfills b USING (subscriber)
WHERE s.subscriber = $1 AND s.segment = $2
FOR UPDATE OF s`

	// advanceSegmentSQL moves the segment's checkpoint and counts the
	// chunk's rows, last in a chunk's transaction: the lock on the
	// backfill's row, which every worker's chunk takes, is held only to
	// the commit. It matches no row once the backfill is paused, even by a
	// pause committed after the chunk began (the row is read again after
	// its lock): the chunk is then rolled back, so no chunk commits after
	// a pause has.
	advanceSegmentSQL = `
WITH segment AS (
    UPDATE subscriber_backfill_segments SET last_key = $3 WHERE subscriber = $1 AND segment = $2
)
UPDATE subscriber_backfills SET done_rows = done_rows + $4, failed_rows = failed_rows + $5, updated_at = now()
WHERE subscriber = $1 AND NOT paused`

	finishBackfillSQL = `
UPDATE subscriber_backfills SET finished_at = now(), updated_at = now()
WHERE subscriber = $1 AND started_at = $2 AND finished_at IS NULL
  AND NOT EXISTS (SELECT FROM subscriber_backfill_segments s WHERE s.subscriber = $1 AND s.last_key < s.to_key)`

	recordBackfillFailureSQL = `
INSERT INTO subscriber_backfill_failures (subscriber, row_key, reason) VALUES ($1, $2, $3)
ON CONFLICT (subscriber, row_key) DO UPDATE SET reason = excluded.reason, failed_at = now()`

	pauseBackfillSQL = `UPDATE subscriber_backfills SET paused = $2, updated_at = now() WHERE subscriber = $1 AND finished_at IS NULL`
)

// Backfills returns every subscriber's backfill, running or finished.
func Backfills(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) ([]BackfillStatus, error) {
	rows, err := q.Query(ctx, backfillStatusSQL+` ORDER BY b.subscriber`)
	if err != nil {
		return nil, fmt.Errorf("read subscriber_backfills: %w", err)
	}
	return pgx.CollectRows(rows, scanBackfill)
}

func scanBackfill(row pgx.CollectableRow) (BackfillStatus, error) {
	var s BackfillStatus
	err := row.Scan(&s.Subscriber, &s.Where, &s.HighKey, &s.Total, &s.Done, &s.Failed, &s.Paused,
		&s.StartedAt, &s.UpdatedAt, &s.FinishedAt, &s.Segments, &s.SegmentsDone)
	return s, err
}

// BackfillState returns subscriber's backfill; ok is false if it never had
// one.
func BackfillState(ctx context.Context, pool *pgxpool.Pool, subscriber string) (s BackfillStatus, ok bool, err error) {
	rows, err := pool.Query(ctx, backfillStatusSQL+` WHERE b.subscriber = $1`, subscriber)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
			return s, false, &badBackfillQuery{fmt.Errorf("read subscriber_backfills: %w (run `fanout migrate`)", err)}
		}
		return s, false, fmt.Errorf("read subscriber_backfills: %w", err)
	}
	s, err = pgx.CollectExactlyOneRow(rows, scanBackfill)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, false, nil
	}
	return s, err == nil, err
}

// PauseBackfill pauses (or resumes) subscriber's unfinished backfill: the
// process running it stops between chunks until it is resumed. Once a
// pause returns, no chunk is applied: a chunk in flight is rolled back
// and done again on resume.
func PauseBackfill(ctx context.Context, pool *pgxpool.Pool, subscriber string, paused bool) error {
	ct, err := pool.Exec(ctx, pauseBackfillSQL, subscriber, paused)
	if err != nil {
		return fmt.Errorf("pause the backfill of %s: %w", subscriber, err)
	}
	if ct.RowsAffected() == 0 {
		return fmt.Errorf("subscriber %s has no unfinished backfill", subscriber)
	}
	return nil
}

// BackfillFailure is a row the backfill could not apply: its dead letter.
type BackfillFailure struct {
	Key      int64
	Reason   string
	FailedAt time.Time
}

// BackfillFailures returns the rows subscriber's backfill could not apply.
func BackfillFailures(ctx context.Context, pool *pgxpool.Pool, subscriber string) ([]BackfillFailure, error) {
	rows, err := pool.Query(ctx, `SELECT row_key, reason, failed_at FROM subscriber_backfill_failures WHERE subscriber = $1 ORDER BY row_key`, subscriber)
	if err != nil {
		return nil, fmt.Errorf("read subscriber_backfill_failures: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[BackfillFailure])
}

// backfiller runs one backfill.
type backfiller struct {
	opts    BackfillOptions
	bf      *Backfill
	name    string
	logger  *slog.Logger
	health  *health
	limiter *rate.Limiter
	chunk   int
	where   string // the backfill's --where, as it started

	mu sync.Mutex
	// failures counts the handler's own failures per row key, for
	// max_failures (in memory: a restart gives a row its tries again).
	failures map[int64]int
	status   BackfillStatus
}

// segment is one worker's part of the key range.
type segment struct {
	n        int
	to, last int64
}

// RunBackfill runs the declaration's backfill until it has handled every
// row it has to, or ctx ends (it resumes from its last chunks when run
// again). While a dependency is down it waits; only the handler's verdict
// on a row makes it a failure (subscriber_backfill_failures).
func RunBackfill(ctx context.Context, opts BackfillOptions) (BackfillStatus, error) {
	d := opts.Declaration
	if d.Backfill == nil {
		return BackfillStatus{}, fmt.Errorf("subscriber %s declares no backfill (Declaration.Backfill)", d.Name)
	}
	if opts.Handler.named == nil {
		return BackfillStatus{}, fmt.Errorf("subscriber %s: no handler", d.Name)
	}
	b := &backfiller{opts: opts, bf: d.Backfill, name: d.Name, chunk: opts.Chunk, failures: map[int64]int{}}
	if b.chunk <= 0 {
		b.chunk = DefaultBackfillChunk
	}
	if b.opts.Workers <= 0 {
		b.opts.Workers = DefaultBackfillWorkers
	}
	b.logger = opts.Logger.With("subscriber", d.Name, "backfill", d.Backfill.Table)
	if opts.Rate > 0 {
		// A chunk is the burst: no more than a second's worth.
		b.chunk = max(1, min(b.chunk, int(math.Ceil(opts.Rate))))
		b.limiter = rate.NewLimiter(rate.Limit(opts.Rate), b.chunk)
	}
	hctx, stopProbes := context.WithCancel(ctx)
	deps := []Dependency{{Name: DependencyPostgres, Probe: opts.Pool.Ping}}
	if dh, ok := opts.Handler.Unwrap().(DependentHandler); ok {
		deps = append(deps, dh.Dependencies()...)
	}
	b.health = newHealth(hctx, d.Name, b.logger, NopObserver{}, deps)
	defer func() {
		stopProbes()
		b.health.wait()
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

// begin resumes the subscriber's unfinished backfill, or starts one, and
// returns its segments.
func (b *backfiller) begin(ctx context.Context) ([]*segment, error) {
	for {
		segments, err := b.tryBegin(ctx)
		if err == nil || !b.outage(ctx, err) {
			return segments, err
		}
	}
}

func (b *backfiller) tryBegin(ctx context.Context) ([]*segment, error) {
	s, ok, err := BackfillState(ctx, b.opts.Pool, b.name)
	if err != nil {
		return nil, err
	}
	if ok && s.Finished() && !b.opts.Restart {
		// A job that is done stays done: run again (by hand, or by a
		// supervisor), it does nothing.
		b.status = s
		b.logger.Info("backfill already finished; --restart runs it again", "finished_at", s.FinishedAt, "done", s.Done, "failed", s.Failed)
		return nil, nil
	}
	if ok && !s.Finished() && !b.opts.Restart {
		if b.opts.Where != "" && b.opts.Where != s.Where {
			return nil, fmt.Errorf("subscriber %s: %w (%q, started %s): run without --where to resume it, or with --restart to start over",
				b.name, ErrBackfillWhere, s.Where, s.StartedAt.Format(time.RFC3339))
		}
		b.status = s
		b.logger.Info("resuming backfill", "where", s.Where, "done", s.Done, "total", s.Total, "segments", s.Segments)
		return b.segments(ctx)
	}
	var low, high, total int64
	if err := b.readOnly(ctx, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, b.bf.boundsSQL(b.opts.Where)).Scan(&low, &high, &total)
	}); err != nil {
		return nil, err
	}
	tx, err := b.opts.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	if _, err := tx.Exec(ctx, startBackfillSQL, b.name, b.opts.Where, high, total); err != nil {
		return nil, fmt.Errorf("record the backfill in subscriber_backfills: %w", err)
	}
	for _, sql := range []string{clearSegmentsSQL, clearBackfillFailuresSQL} {
		if _, err := tx.Exec(ctx, sql, b.name); err != nil {
			return nil, fmt.Errorf("clear the last backfill: %w", err)
		}
	}
	for i, r := range split(low, high, b.opts.Workers) {
		if _, err := tx.Exec(ctx, addSegmentSQL, b.name, i, r[0], r[1]); err != nil {
			return nil, fmt.Errorf("record the backfill's segments: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, err
	}
	if b.status, _, err = BackfillState(ctx, b.opts.Pool, b.name); err != nil {
		return nil, err
	}
	b.logger.Info("backfill started", "where", b.opts.Where, "rows", total, "through_key", high, "segments", b.status.Segments)
	return b.segments(ctx)
}

// split divides the keys after low-1, up to high, into n ranges (from,
// to] of equal width; one range when there is nothing to split.
func split(low, high int64, n int) [][2]int64 {
	from := low
	if low > math.MinInt64 {
		from = low - 1
	}
	if high <= from || n <= 1 {
		return [][2]int64{{from, max(high, from)}}
	}
	width := uint64(high-from) / uint64(n) // the difference fits in a uint64 even when it overflows an int64
	if width == 0 {
		return [][2]int64{{from, high}}
	}
	var out [][2]int64
	for i := range n {
		to := int64(uint64(from) + width*uint64(i+1))
		if i == n-1 {
			to = high
		}
		out = append(out, [2]int64{int64(uint64(from) + width*uint64(i)), to})
	}
	return out
}

func (b *backfiller) segments(ctx context.Context) ([]*segment, error) {
	rows, err := b.opts.Pool.Query(ctx, segmentsSQL, b.name)
	if err != nil {
		return nil, err
	}
	var out []*segment
	var sg segment
	_, err = pgx.ForEachRow(rows, []any{&sg.n, &sg.to, &sg.last}, func() error {
		c := sg
		out = append(out, &c)
		return nil
	})
	if err == nil && len(out) == 0 {
		err = fmt.Errorf("subscriber %s: its backfill has no segments (subscriber_backfill_segments): run it with --restart", b.name)
	}
	return out, err
}

// readOnly runs f in a read-only transaction: the operator's --where can
// read what the role may read, and change nothing.
func (b *backfiller) readOnly(ctx context.Context, f func(pgx.Tx) error) error {
	tx, err := b.opts.Pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // read only
	if err := f(tx); err != nil {
		return b.queryError(err)
	}
	return tx.Commit(ctx)
}

// queryError names what the backfill's own SQL got wrong: the --where or
// the declaration's expressions, which no retry can fix.
func (b *backfiller) queryError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code[:2] == "42" || pgErr.Code[:2] == "22" || pgErr.Code == "25006") {
		return &badBackfillQuery{fmt.Errorf("subscriber %s: the backfill's query (the declaration's table %s, its expressions, and --where %q) fails: %w",
			b.name, b.bf.Table, b.opts.Where, err)}
	}
	return err
}

type badBackfillQuery struct{ err error }

func (e *badBackfillQuery) Error() string { return e.err.Error() }
func (e *badBackfillQuery) Unwrap() error { return e.err }

// outage reports whether err is Postgres (or the handler's dependency)
// being unavailable, and if so waits until it answers again. A bad query
// and a stopped context are not outages.
func (b *backfiller) outage(ctx context.Context, err error) bool {
	var bad *badBackfillQuery
	if ctx.Err() != nil || errors.As(err, &bad) {
		return false
	}
	if !connectivity(err) && !errors.Is(err, context.DeadlineExceeded) {
		// Not a broken connection: an outage only if Postgres does not
		// answer a ping either; otherwise the error is the backfill's own.
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		perr := b.opts.Pool.Ping(pctx)
		cancel()
		if perr == nil || ctx.Err() != nil {
			return false
		}
		err = perr
	}
	b.logger.Warn("backfill waits for postgres", "error", err)
	b.health.markDown(DependencyPostgres, err)
	return b.health.waitUp(ctx)
}

type backfillRow struct {
	key     int64
	id      string
	payload []byte
}

// run runs a worker per unfinished segment, then marks the backfill
// finished once every segment is.
func (b *backfiller) run(ctx context.Context, segments []*segment) (BackfillStatus, error) {
	g, gctx := errgroup.WithContext(ctx)
	for _, sg := range segments {
		g.Go(func() error { return b.runSegment(gctx, sg) })
	}
	if err := g.Wait(); err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return b.snapshot(), err
	}
	for {
		_, err := b.opts.Pool.Exec(ctx, finishBackfillSQL, b.name, b.snapshot().StartedAt)
		if err == nil {
			break
		}
		if !b.outage(ctx, err) {
			return b.snapshot(), err
		}
	}
	s, _, err := BackfillState(ctx, b.opts.Pool, b.name)
	if err != nil {
		return b.snapshot(), err
	}
	if !s.Finished() {
		return s, fmt.Errorf("subscriber %s: its backfill was restarted elsewhere", b.name)
	}
	b.mu.Lock()
	b.status = s
	b.mu.Unlock()
	b.logger.Info("backfill finished", "done", s.Done, "failed", s.Failed)
	b.report()
	return s, nil
}

func (b *backfiller) snapshot() BackfillStatus {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.status
}

// runSegment handles a segment's chunks until its last.
func (b *backfiller) runSegment(ctx context.Context, sg *segment) error {
	// The next chunk is read while this one is applied: the read's round
	// trips and the apply's overlap, on two connections.
	var ahead *readAhead
	defer func() { ahead.discard() }()
	for sg.last < sg.to {
		if err := ctx.Err(); err != nil {
			return err
		}
		if b.snapshot().Paused {
			// What was read before the pause is not applied after it.
			ahead.discard()
			ahead = nil
			if err := b.waitPaused(ctx); err != nil {
				return err
			}
			continue
		}
		if !b.health.waitUp(ctx) {
			return ctx.Err()
		}
		readStart := time.Now()
		var rows []backfillRow
		var err error
		if ahead != nil && ahead.from == sg.last {
			rows, err = ahead.wait()
		} else {
			ahead.discard()
			rows, err = b.read(ctx, sg.last, sg.to)
		}
		ahead = nil
		readTook := time.Since(readStart)
		if err != nil {
			if b.outage(ctx, err) {
				continue
			}
			return err
		}
		if b.opts.Hooks.AfterRead != nil {
			keys := make([]int64, len(rows))
			for i, r := range rows {
				keys[i] = r.key
			}
			b.opts.Hooks.AfterRead(keys)
		}
		if b.limiter != nil && len(rows) > 0 {
			if err := b.limiter.WaitN(ctx, len(rows)); err != nil {
				return ctx.Err()
			}
		}
		if len(rows) == b.chunk {
			ahead = b.readAhead(ctx, rows[len(rows)-1].key, sg.to)
		}
		applyStart := time.Now()
		if err := b.apply(ctx, sg, rows); err != nil {
			// A deadlock or serialization failure is the company the
			// chunk met, not the chunk: again.
			if errors.Is(err, errChunkAgain) || conflict(err) || b.outage(ctx, err) {
				continue
			}
			return err
		}
		b.logger.Debug("backfill chunk", "segment", sg.n, "rows", len(rows), "last_key", sg.last, "read", readTook, "apply", time.Since(applyStart))
		b.report()
	}
	return nil
}

func (b *backfiller) report() {
	if b.opts.Progress == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.opts.Progress(b.status)
}

// waitPaused polls the backfill's row until it is resumed (or restarted,
// or finished, elsewhere).
func (b *backfiller) waitPaused(ctx context.Context) error {
	b.logger.Info("backfill paused", "done", b.snapshot().Done, "total", b.snapshot().Total)
	b.report()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
		s, _, err := BackfillState(ctx, b.opts.Pool, b.name)
		if err != nil {
			if b.outage(ctx, err) {
				continue
			}
			return err
		}
		b.mu.Lock()
		if !s.StartedAt.Equal(b.status.StartedAt) {
			b.mu.Unlock()
			return fmt.Errorf("subscriber %s: its backfill was restarted elsewhere while paused here", b.name)
		}
		b.status = s
		b.mu.Unlock()
		if !s.Paused {
			b.logger.Info("backfill resumed")
			return nil
		}
	}
}

// readAhead is a chunk's read running while the chunk before it applies.
type readAhead struct {
	from   int64 // the key the chunk starts after
	cancel context.CancelFunc
	done   chan struct{}
	rows   []backfillRow
	err    error
}

func (b *backfiller) readAhead(ctx context.Context, from, to int64) *readAhead {
	ctx, cancel := context.WithCancel(ctx)
	ra := &readAhead{from: from, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(ra.done)
		ra.rows, ra.err = b.read(ctx, from, to)
	}()
	return ra
}

func (ra *readAhead) wait() ([]backfillRow, error) {
	<-ra.done
	ra.cancel()
	return ra.rows, ra.err
}

// discard stops a read no longer wanted (the chunk before it was not
// applied, or the backfill paused or stopped) and waits for it to end.
func (ra *readAhead) discard() {
	if ra != nil {
		ra.cancel()
		<-ra.done
	}
}

// read reads the chunk after key from, up to key to.
func (b *backfiller) read(ctx context.Context, from, to int64) ([]backfillRow, error) {
	var rows []backfillRow
	err := b.readOnly(ctx, func(tx pgx.Tx) error {
		rs, err := tx.Query(ctx, b.bf.chunkSQL(b.where), from, to, b.chunk)
		if err != nil {
			return err
		}
		rows, err = pgx.CollectRows(rs, func(row pgx.CollectableRow) (backfillRow, error) {
			var r backfillRow
			var id *string
			err := row.Scan(&r.key, &id, &r.payload)
			if id != nil {
				r.id = *id
			}
			return r, err
		})
		return err
	})
	return rows, err
}

// errChunkAgain: the chunk is to be read and handled again (after a
// failure the handler may get over, or another process moved the
// backfill on).
var errChunkAgain = errors.New("handle the chunk again")

func (b *backfiller) event(r backfillRow) Event {
	return Event{
		Type: b.bf.EventType, AggregateType: b.bf.AggregateType, AggregateID: r.id,
		Payload:   r.payload,
		Headers:   nats.Header{BackfillHeader: []string{b.bf.Table + ":" + strconv.FormatInt(r.key, 10)}},
		CreatedAt: time.Now(), Delivery: uint64(b.failureCount(r.key)) + 1,
	}
}

func (b *backfiller) failureCount(key int64) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.failures[key]
}

// verdict is the backfill's judgement of a failed row.
type verdict int

const (
	verdictOutage verdict = iota
	verdictAgain          // not the row's fault (a conflict, a snooze): again, uncounted
	verdictFailed         // the handler's failure: counted towards max_failures
	verdictDead           // permanent, or max_failures reached: a failure row
)

func (b *backfiller) judge(ctx context.Context, key int64, err error) (verdict, string) {
	switch res := judgeError(ctx, b.health, err); res.kind {
	case resultAbandoned, resultOutage:
		return verdictOutage, ""
	case resultPermanent:
		return verdictDead, err.Error()
	case resultSnooze, resultRetry:
		return verdictAgain, ""
	}
	b.mu.Lock()
	b.failures[key]++
	n := b.failures[key]
	b.mu.Unlock()
	if n >= b.opts.Config.MaxFailures {
		return verdictDead, fmt.Sprintf("gave up after %d failures (subscribers.max_failures): %v", n, err)
	}
	b.logger.Warn("backfill row failed, will retry", "key", key, "failures", n, "error", err)
	return verdictFailed, ""
}

// apply hands a chunk to the handler and moves the segment's checkpoint
// past it, in one transaction.
func (b *backfiller) apply(ctx context.Context, sg *segment, rows []backfillRow) error {
	actx, cancel := context.WithTimeout(ctx, b.opts.Config.HandlerTimeout+10*time.Second)
	defer cancel()
	// The chunk's commit need not wait for its WAL to reach the disk: a
	// crash that loses it loses its checkpoint with it (one transaction),
	// and the backfill does the chunk again. The live events' commits stop
	// queueing behind the backfill's. (Sent with the BEGIN: a round trip
	// less per chunk.)
	tx, err := b.opts.Pool.BeginTx(actx, pgx.TxOptions{BeginQuery: `BEGIN; SET LOCAL synchronous_commit = off`})
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	var last int64
	var started time.Time
	var paused bool
	if err := tx.QueryRow(actx, lockSegmentSQL, b.name, sg.n).Scan(&last, &started, &paused); err != nil {
		return fmt.Errorf("lock the backfill's segment %d: %w", sg.n, err)
	}
	if last != sg.last || !started.Equal(b.snapshot().StartedAt) || paused {
		return b.reload(ctx, sg, last, started, paused)
	}
	dead := map[int64]string{}
	var failed bool
	if th, ok := b.opts.Handler.TxHandler(); ok {
		failed, err = b.applyTx(actx, tx, th, rows, dead)
	} else {
		eh, _ := b.opts.Handler.EventHandler()
		failed, err = b.applyEach(actx, eh, rows, dead)
	}
	if err != nil {
		return err
	}
	if failed {
		// A row the handler failed on, not yet given up: the chunk again,
		// after the backoff its failures earned.
		n := 0
		b.mu.Lock()
		for _, r := range rows {
			n = max(n, b.failures[r.key])
		}
		b.mu.Unlock()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(retryBackoff(b.opts.Config, uint64(n))):
		}
		return errChunkAgain
	}
	for key, reason := range dead {
		if _, err := tx.Exec(actx, recordBackfillFailureSQL, b.name, key, reason); err != nil {
			return fmt.Errorf("record backfill failure: %w", err)
		}
		b.logger.Error("backfill row failed", "key", key, "reason", reason)
	}
	newLast := sg.to
	if len(rows) == b.chunk {
		newLast = rows[len(rows)-1].key
	}
	applied := int64(len(rows) - len(dead))
	if apart := b.opts.Hooks.CheckpointApart; apart > 0 {
		if err := tx.Commit(actx); err != nil {
			return err
		}
		time.Sleep(apart)
		if tx, err = b.opts.Pool.Begin(actx); err != nil {
			return err
		}
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	}
	ct, err := tx.Exec(actx, advanceSegmentSQL, b.name, sg.n, newLast, applied, int64(len(dead)))
	if err != nil {
		return fmt.Errorf("advance the backfill: %w", err)
	}
	if ct.RowsAffected() == 0 {
		// Paused while the chunk applied: undone, and done on resume.
		return b.reload(ctx, sg, sg.last, b.snapshot().StartedAt, true)
	}
	if err := tx.Commit(actx); err != nil {
		return fmt.Errorf("commit the chunk: %w", err)
	}
	sg.last = newLast
	b.mu.Lock()
	for _, r := range rows {
		delete(b.failures, r.key)
	}
	b.status.Done += applied
	b.status.Failed += int64(len(dead))
	b.status.UpdatedAt = time.Now()
	if newLast >= sg.to {
		b.status.SegmentsDone++
	}
	b.mu.Unlock()
	return nil
}

// reload takes the segment as another process (or an operator's pause)
// left it.
func (b *backfiller) reload(ctx context.Context, sg *segment, last int64, started time.Time, paused bool) error {
	if !started.Equal(b.snapshot().StartedAt) {
		return fmt.Errorf("subscriber %s: its backfill was restarted elsewhere", b.name)
	}
	sg.last = last
	if paused {
		b.mu.Lock()
		b.status.Paused = true
		b.mu.Unlock()
	}
	return errChunkAgain
}

// applyTx runs the chunk in tx, with the checkpoint's move: as one batch
// if the handler takes batches, else (or if the batch fails) row by row
// under savepoints, so a bad row is recorded and the others applied.
func (b *backfiller) applyTx(ctx context.Context, tx pgx.Tx, th TxHandler, rows []backfillRow, dead map[int64]string) (failed bool, err error) {
	if bh, ok := th.(BatchTxHandler); ok && len(rows) > 1 {
		evs := make([]Event, len(rows))
		for i, r := range rows {
			evs[i] = b.event(r)
		}
		err := inSavepoint(ctx, tx, func(tx pgx.Tx) (err error) {
			defer recoverHandler(evs[0], &err)
			return bh.HandleBatchTx(ctx, tx, evs)
		})
		if err == nil {
			b.health.handlerWorked()
			return false, nil
		}
		if dep, ok := IsUnavailable(err); ok {
			b.health.markDown(dep, err)
		}
		if ctx.Err() != nil || b.health.probeAll(ctx) {
			return false, b.wrapOutage(ctx, err)
		}
		// Row by row, where each row's error is its own verdict.
	}
	for _, r := range rows {
		ev := b.event(r)
		err := inSavepoint(ctx, tx, func(tx pgx.Tx) (err error) {
			defer recoverHandler(ev, &err)
			return th.HandleTx(ctx, tx, ev)
		})
		if err == nil {
			continue
		}
		switch v, reason := b.judge(ctx, r.key, err); v {
		case verdictOutage:
			return false, b.wrapOutage(ctx, err)
		case verdictAgain, verdictFailed:
			failed = true
		case verdictDead:
			dead[r.key] = reason
		}
	}
	if !failed {
		b.health.handlerWorked()
	}
	return failed, nil
}

// applyEach hands the chunk to a handler whose effects live outside
// Postgres: it is idempotent, so a chunk handled again after a crash does
// no harm.
func (b *backfiller) applyEach(ctx context.Context, eh EventHandler, rows []backfillRow, dead map[int64]string) (failed bool, err error) {
	evs := make([]Event, len(rows))
	for i, r := range rows {
		evs[i] = b.event(r)
	}
	errs := make([]error, len(evs))
	if bh, ok := eh.(BatchEventHandler); ok && len(evs) > 1 {
		func() {
			defer func() {
				if p := recover(); p != nil {
					for i := range errs {
						errs[i] = fmt.Errorf("handler panicked: %v", p)
					}
				}
			}()
			errs = bh.HandleBatch(ctx, evs)
		}()
		if len(errs) != len(evs) {
			return false, fmt.Errorf("subscriber %s: HandleBatch returned %d errors for %d events", b.name, len(errs), len(evs))
		}
	} else {
		for i, ev := range evs {
			func() {
				defer recoverHandler(ev, &errs[i])
				errs[i] = eh.Handle(ctx, ev)
			}()
		}
	}
	for i, err := range errs {
		if err == nil {
			continue
		}
		switch v, reason := b.judge(ctx, rows[i].key, err); v {
		case verdictOutage:
			return false, b.wrapOutage(ctx, err)
		case verdictAgain, verdictFailed:
			failed = true
		case verdictDead:
			dead[rows[i].key] = reason
		}
	}
	if !failed {
		b.health.handlerWorked()
	}
	return failed, nil
}

// wrapOutage turns a failure during an outage into the error run waits
// out: the health breakers already know which dependency is down.
func (b *backfiller) wrapOutage(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	b.logger.Warn("backfill waits for its dependencies", "error", err)
	if !b.health.waitUp(ctx) {
		return ctx.Err()
	}
	return errChunkAgain
}

// inSavepoint runs f in a savepoint of tx, rolled back if f fails.
func inSavepoint(ctx context.Context, tx pgx.Tx, f func(pgx.Tx) error) error {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return err
	}
	if err := f(sp); err != nil {
		_ = sp.Rollback(ctx)
		return err
	}
	return sp.Commit(ctx)
}
