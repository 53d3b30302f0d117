package backfill

// The backfill's course: begun (or resumed) with its segments, a worker
// per segment running its chunks in key order, paused and resumed by an
// operator, finished once every segment is.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"
)

// breakers is what the backfill needs of the live runtime's dependency
// breakers (subscribers.Health): the same outages, probes and verdicts.
type breakers interface {
	MarkDown(dependency string, err error)
	WaitUp(ctx context.Context) bool
	ProbeAll(ctx context.Context) bool
	Probe(ctx context.Context, dependency string) error
	HandlerWorked()
	Judge(ctx context.Context, err error) subscribers.Outcome
}

// backfiller runs one backfill.
type backfiller struct {
	opts    Options
	bf      *subscribers.Backfill
	name    string
	store   bookkeeping.Store // on opts.Pool
	logger  *slog.Logger
	health  breakers
	limiter *rate.Limiter
	chunk   int
	where   string // the backfill's --where, as it started

	mu sync.Mutex
	// failures counts the handler's own failures per row key, for
	// max_failures (in memory: a restart gives a row its tries again).
	failures map[int64]int
	status   Status
}

func newBackfiller(opts Options) *backfiller {
	d := opts.Declaration
	b := &backfiller{opts: opts, bf: d.Backfill, name: d.Name, store: bookkeeping.New(opts.Pool), chunk: opts.Chunk, failures: map[int64]int{}}
	if b.chunk <= 0 {
		b.chunk = DefaultChunk
	}
	if b.opts.Workers <= 0 {
		b.opts.Workers = DefaultWorkers
	}
	b.logger = opts.Logger.With("subscriber", d.Name, "backfill", d.Backfill.Table)
	if opts.Rate > 0 {
		// A chunk is the burst: no more than a second's worth.
		b.chunk = max(1, min(b.chunk, int(math.Ceil(opts.Rate))))
		b.limiter = rate.NewLimiter(rate.Limit(opts.Rate), b.chunk)
	}
	return b
}

// segment is one worker's part of the key range; its Last moves as its
// chunks commit.
type segment = bookkeeping.BackfillSegment

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
	s, ok, err := b.state(ctx)
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
				b.name, ErrWhere, s.Where, s.StartedAt.Format(time.RFC3339))
		}
		b.status = s
		b.logger.Info("resuming backfill", "where", s.Where, "done", s.Done, "total", s.Total, "segments", s.Segments)
		return b.segments(ctx)
	}
	var low, high, total int64
	if err := b.readOnly(ctx, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, boundsSQL(b.bf, b.opts.Where)).Scan(&low, &high, &total)
	}); err != nil {
		return nil, err
	}
	err = b.store.BackfillStart(ctx, bookkeeping.BackfillStartParams{Subscriber: b.name, Where: b.opts.Where, HighKey: high, Total: total,
		Segments: split(low, high, b.opts.Workers)})
	if err != nil {
		return nil, err
	}
	if b.status, _, err = b.state(ctx); err != nil {
		return nil, err
	}
	b.logger.Info("backfill started", "where", b.opts.Where, "rows", total, "through_key", high, "segments", b.status.Segments)
	return b.segments(ctx)
}

// state reads the backfill's row; ok is false if it never had one.
func (b *backfiller) state(ctx context.Context) (Status, bool, error) {
	s, ok, err := b.store.BackfillGet(ctx, b.name)
	if bookkeeping.IsUndefinedTable(err) {
		return s, false, &badQuery{fmt.Errorf("read subscriber_backfills: %w (run `fanout migrate`)", err)}
	}
	if err != nil {
		return s, false, fmt.Errorf("read subscriber_backfills: %w", err)
	}
	return s, ok, nil
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
	rows, err := b.store.BackfillSegmentList(ctx, b.name)
	if err != nil {
		return nil, err
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("subscriber %s: its backfill has no segments (subscriber_backfill_segments): run it with --restart", b.name)
	}
	out := make([]*segment, len(rows))
	for i := range rows {
		out[i] = &rows[i]
	}
	return out, nil
}

// run runs a worker per unfinished segment, then marks the backfill
// finished once every segment is.
func (b *backfiller) run(ctx context.Context, segments []*segment) (Status, error) {
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
		err := b.store.BackfillFinish(ctx, bookkeeping.BackfillFinishParams{Subscriber: b.name, StartedAt: b.snapshot().StartedAt})
		if err == nil {
			break
		}
		if !b.outage(ctx, err) {
			return b.snapshot(), err
		}
	}
	s, _, err := b.state(ctx)
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

func (b *backfiller) snapshot() Status {
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
	for sg.Last < sg.To {
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
		if !b.health.WaitUp(ctx) {
			return ctx.Err()
		}
		readStart := time.Now()
		var rows []row
		var err error
		if ahead != nil && ahead.from == sg.Last {
			rows, err = ahead.wait()
		} else {
			ahead.discard()
			rows, err = b.read(ctx, sg.Last, sg.To)
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
			ahead = b.readAhead(ctx, rows[len(rows)-1].key, sg.To)
		}
		applyStart := time.Now()
		if err := b.apply(ctx, sg, rows); err != nil {
			// A deadlock or serialization failure is the company the
			// chunk met, not the chunk: again.
			if errors.Is(err, errChunkAgain) || subscribers.IsConflict(err) || b.outage(ctx, err) {
				continue
			}
			return err
		}
		b.logger.Debug("backfill chunk", "segment", sg.N, "rows", len(rows), "last_key", sg.Last, "read", readTook, "apply", time.Since(applyStart))
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
		s, _, err := b.state(ctx)
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

// outage reports whether err is Postgres (or the handler's dependency)
// being unavailable, and if so waits until it answers again. A bad query
// and a stopped context are not outages.
func (b *backfiller) outage(ctx context.Context, err error) bool {
	var bad *badQuery
	if ctx.Err() != nil || errors.As(err, &bad) {
		return false
	}
	if !subscribers.IsConnectionFailure(err) && !errors.Is(err, context.DeadlineExceeded) {
		// Not a broken connection: an outage only if Postgres does not
		// answer a ping either; otherwise the error is the backfill's own.
		perr := b.health.Probe(ctx, subscribers.DependencyPostgres)
		if perr == nil || ctx.Err() != nil {
			return false
		}
		err = perr
	}
	b.logger.Warn("backfill waits for postgres", "error", err)
	b.health.MarkDown(subscribers.DependencyPostgres, err)
	return b.health.WaitUp(ctx)
}
