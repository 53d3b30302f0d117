package subscribers

// The backfill's runtime: chunks read in key order, handed to the handler
// with the verdicts, outages and dead letters of the live runtime, and a
// checkpoint (subscriber_backfills.last_key) that commits with a
// TxHandler's effects.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
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
	// Rate limits the rows handled per second; 0 is no limit.
	Rate float64
	// Chunk is the rows per chunk (one transaction): 500 when 0.
	Chunk int
	// Restart starts over even if a backfill is unfinished.
	Restart bool
	// Progress, if set, is called after every chunk and while paused.
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
	Subscriber  string
	Where       string
	HighKey     int64
	LastKey     int64
	Total       int64
	Done        int64
	Failed      int64
	Paused      bool
	StartedAt   time.Time
	UpdatedAt   time.Time
	FinishedAt  *time.Time
	initialized bool
}

// Finished reports whether the backfill has done its last chunk.
func (s BackfillStatus) Finished() bool { return s.FinishedAt != nil }

// ErrBackfillWhere is wrapped by the error of a backfill whose --where
// differs from the one its unfinished backfill started with.
var ErrBackfillWhere = errors.New("an unfinished backfill has another --where")

const (
	backfillStatusSQL = `SELECT subscriber, where_sql, high_key, last_key, total_rows, done_rows, failed_rows, paused,
       started_at, updated_at, finished_at FROM subscriber_backfills`

	startBackfillSQL = `
INSERT INTO subscriber_backfills AS b (subscriber, where_sql, high_key, last_key, total_rows)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (subscriber) DO UPDATE
SET where_sql = excluded.where_sql, high_key = excluded.high_key, last_key = excluded.last_key,
    total_rows = excluded.total_rows, done_rows = 0, failed_rows = 0, paused = false,
    started_at = now(), updated_at = now(), finished_at = NULL`

	clearBackfillFailuresSQL = `DELETE FROM subscriber_backfill_failures WHERE subscriber = $1`

	// lockBackfillSQL fences a chunk: another process running the same
	// backfill, or a restart, moved it on if last_key or started_at differ.
	lockBackfillSQL = `SELECT last_key, started_at, paused FROM subscriber_backfills WHERE subscriber = $1 FOR UPDATE`

	advanceBackfillSQL = `
UPDATE subscriber_backfills SET last_key = $2, done_rows = done_rows + $3, failed_rows = failed_rows + $4,
    updated_at = now(), finished_at = CASE WHEN $5 THEN now() END
WHERE subscriber = $1`

	recordBackfillFailureSQL = `
INSERT INTO subscriber_backfill_failures (subscriber, row_key, reason) VALUES ($1, $2, $3)
ON CONFLICT (subscriber, row_key) DO UPDATE SET reason = excluded.reason, failed_at = now()`

	pauseBackfillSQL = `UPDATE subscriber_backfills SET paused = $2, updated_at = now() WHERE subscriber = $1 AND finished_at IS NULL`
)

// Backfills returns every subscriber's backfill, running or finished.
func Backfills(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) ([]BackfillStatus, error) {
	rows, err := q.Query(ctx, backfillStatusSQL+` ORDER BY subscriber`)
	if err != nil {
		return nil, fmt.Errorf("read subscriber_backfills: %w", err)
	}
	return pgx.CollectRows(rows, scanBackfill)
}

func scanBackfill(row pgx.CollectableRow) (BackfillStatus, error) {
	var s BackfillStatus
	err := row.Scan(&s.Subscriber, &s.Where, &s.HighKey, &s.LastKey, &s.Total, &s.Done, &s.Failed, &s.Paused,
		&s.StartedAt, &s.UpdatedAt, &s.FinishedAt)
	s.initialized = err == nil
	return s, err
}

// BackfillState returns subscriber's backfill; ok is false if it never had
// one.
func BackfillState(ctx context.Context, pool *pgxpool.Pool, subscriber string) (s BackfillStatus, ok bool, err error) {
	rows, err := pool.Query(ctx, backfillStatusSQL+` WHERE subscriber = $1`, subscriber)
	if err != nil {
		return s, false, fmt.Errorf("read subscriber_backfills: %w", err)
	}
	s, err = pgx.CollectExactlyOneRow(rows, scanBackfill)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, false, nil
	}
	return s, err == nil, err
}

// PauseBackfill pauses (or resumes) subscriber's unfinished backfill: the
// process running it stops between chunks until it is resumed.
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
	// failures counts the handler's own failures per row key, for
	// max_failures (in memory: a restart gives a row its tries again).
	failures map[int64]int
	status   BackfillStatus
}

// RunBackfill runs the declaration's backfill until it has handled every
// row it has to, or ctx ends (it resumes from its last chunk when run
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
		b.chunk = 500
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
	if err := b.begin(ctx); err != nil {
		return b.status, err
	}
	return b.status, b.run(ctx)
}

// begin resumes the subscriber's unfinished backfill, or starts one.
func (b *backfiller) begin(ctx context.Context) error {
	for {
		err := b.tryBegin(ctx)
		if err == nil || !b.outage(ctx, err) {
			return err
		}
	}
}

func (b *backfiller) tryBegin(ctx context.Context) error {
	s, ok, err := BackfillState(ctx, b.opts.Pool, b.name)
	if err != nil {
		return err
	}
	if ok && !s.Finished() && !b.opts.Restart {
		if b.opts.Where != "" && b.opts.Where != s.Where {
			return fmt.Errorf("subscriber %s: %w (%q, started %s): run without --where to resume it, or with --restart to start over",
				b.name, ErrBackfillWhere, s.Where, s.StartedAt.Format(time.RFC3339))
		}
		b.status = s
		b.logger.Info("resuming backfill", "where", s.Where, "last_key", s.LastKey, "done", s.Done, "total", s.Total)
		return nil
	}
	var high, total int64
	if err := b.readOnly(ctx, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, b.bf.boundsSQL(b.opts.Where)).Scan(&high, &total)
	}); err != nil {
		return err
	}
	tx, err := b.opts.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	if _, err := tx.Exec(ctx, startBackfillSQL, b.name, b.opts.Where, high, int64(math.MinInt64), total); err != nil {
		return fmt.Errorf("record the backfill in subscriber_backfills: %w", err)
	}
	if _, err := tx.Exec(ctx, clearBackfillFailuresSQL, b.name); err != nil {
		return fmt.Errorf("clear the last backfill's failures: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	s, _, err = BackfillState(ctx, b.opts.Pool, b.name)
	b.status = s
	b.logger.Info("backfill started", "where", b.opts.Where, "rows", total, "through_key", high)
	return err
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

// run handles chunks until the last.
func (b *backfiller) run(ctx context.Context) error {
	for {
		if b.status.Finished() {
			b.report()
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if b.status.Paused {
			b.report()
			if err := b.waitPaused(ctx); err != nil {
				return err
			}
			continue
		}
		if !b.health.waitUp(ctx) {
			return ctx.Err()
		}
		rows, err := b.read(ctx)
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
		if err := b.apply(ctx, rows); err != nil {
			if errors.Is(err, errChunkAgain) || b.outage(ctx, err) {
				continue
			}
			return err
		}
		b.report()
	}
}

func (b *backfiller) report() {
	if b.opts.Progress != nil {
		b.opts.Progress(b.status)
	}
}

// waitPaused polls the backfill's row until it is resumed (or restarted,
// or finished, elsewhere).
func (b *backfiller) waitPaused(ctx context.Context) error {
	b.logger.Info("backfill paused", "done", b.status.Done, "total", b.status.Total)
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
		if s.StartedAt != b.status.StartedAt {
			return fmt.Errorf("subscriber %s: its backfill was restarted elsewhere while paused here", b.name)
		}
		b.status = s
		if !s.Paused {
			b.logger.Info("backfill resumed")
			return nil
		}
	}
}

// read reads the next chunk in its own snapshot.
func (b *backfiller) read(ctx context.Context) ([]backfillRow, error) {
	var rows []backfillRow
	err := b.readOnly(ctx, func(tx pgx.Tx) error {
		rs, err := tx.Query(ctx, b.bf.chunkSQL(b.status.Where), b.status.LastKey, b.status.HighKey, b.chunk)
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
		CreatedAt: time.Now(), Delivery: uint64(b.failures[r.key]) + 1,
	}
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
	if ctx.Err() != nil {
		return verdictOutage, ""
	}
	if IsPermanent(err) {
		return verdictDead, err.Error()
	}
	if dep, ok := IsUnavailable(err); ok {
		b.health.markDown(dep, err)
		return verdictOutage, ""
	}
	if _, ok := retryDelay(err); ok {
		return verdictAgain, ""
	}
	if b.health.probeAll(ctx) {
		return verdictOutage, ""
	}
	if connectivity(err) || conflict(err) {
		return verdictAgain, ""
	}
	b.failures[key]++
	if n := b.failures[key]; n >= b.opts.Config.MaxFailures {
		return verdictDead, fmt.Sprintf("gave up after %d failures (subscribers.max_failures): %v", n, err)
	}
	b.logger.Warn("backfill row failed, will retry", "key", key, "failures", b.failures[key], "error", err)
	return verdictFailed, ""
}

// apply hands a chunk to the handler and moves the checkpoint past it.
func (b *backfiller) apply(ctx context.Context, rows []backfillRow) error {
	actx, cancel := context.WithTimeout(ctx, b.opts.Config.HandlerTimeout+10*time.Second)
	defer cancel()
	tx, err := b.opts.Pool.Begin(actx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	var last int64
	var started time.Time
	var paused bool
	if err := tx.QueryRow(actx, lockBackfillSQL, b.name).Scan(&last, &started, &paused); err != nil {
		return fmt.Errorf("lock the backfill's row: %w", err)
	}
	if last != b.status.LastKey || !started.Equal(b.status.StartedAt) || paused {
		return b.reload(ctx, started)
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
		for _, f := range b.failures {
			n = max(n, f)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(b.backoff(n)):
		}
		return errChunkAgain
	}
	for key, reason := range dead {
		if _, err := tx.Exec(actx, recordBackfillFailureSQL, b.name, key, reason); err != nil {
			return fmt.Errorf("record backfill failure: %w", err)
		}
		b.logger.Error("backfill row failed", "key", key, "reason", reason)
	}
	newLast := b.status.HighKey
	finished := len(rows) < b.chunk
	if len(rows) > 0 {
		newLast = rows[len(rows)-1].key
		finished = finished || newLast >= b.status.HighKey
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
	if _, err := tx.Exec(actx, advanceBackfillSQL, b.name, newLast, applied, int64(len(dead)), finished); err != nil {
		return fmt.Errorf("advance the backfill: %w", err)
	}
	if err := tx.Commit(actx); err != nil {
		return fmt.Errorf("commit the chunk: %w", err)
	}
	for _, r := range rows {
		delete(b.failures, r.key)
	}
	b.status.LastKey = newLast
	b.status.Done += applied
	b.status.Failed += int64(len(dead))
	b.status.UpdatedAt = time.Now()
	if finished {
		now := time.Now()
		b.status.FinishedAt = &now
		b.logger.Info("backfill finished", "done", b.status.Done, "failed", b.status.Failed)
	}
	return nil
}

// reload takes the backfill's row as another process (or an operator's
// pause) left it.
func (b *backfiller) reload(ctx context.Context, started time.Time) error {
	if !started.Equal(b.status.StartedAt) {
		return fmt.Errorf("subscriber %s: its backfill was restarted elsewhere", b.name)
	}
	s, _, err := BackfillState(ctx, b.opts.Pool, b.name)
	if err != nil {
		return err
	}
	b.status = s
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

// backoff is retry_min doubled per failure after the first, capped at
// retry_max.
func (b *backfiller) backoff(n int) time.Duration {
	d := b.opts.Config.RetryMin
	for i := 1; i < n && d < b.opts.Config.RetryMax; i++ {
		d *= 2
	}
	return min(d, b.opts.Config.RetryMax)
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
