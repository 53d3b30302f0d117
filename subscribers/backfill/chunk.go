package backfill

// A chunk: read in a read-only transaction (the operator's --where can
// change nothing), handed to the handler row by row or as a batch, judged
// as the live runtime judges an event, and committed with its segment's
// checkpoint.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype/zeronull"
	"github.com/nats-io/nats.go"
)

// row is one row of the backfill's table, as the chunk's query reads it.
type row struct {
	key     int64
	id      string
	payload []byte
}

// readAhead is a chunk's read running while the chunk before it applies.
type readAhead struct {
	from   int64 // the key the chunk starts after
	cancel context.CancelFunc
	done   chan struct{}
	rows   []row
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

func (ra *readAhead) wait() ([]row, error) {
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
func (b *backfiller) read(ctx context.Context, from, to int64) ([]row, error) {
	var rows []row
	err := b.readOnly(ctx, func(tx pgx.Tx) error {
		rs, err := tx.Query(ctx, chunkSQL(b.bf, b.where), from, to, b.chunk)
		if err != nil {
			return err
		}
		rows, err = pgx.CollectRows(rs, func(cr pgx.CollectableRow) (r row, err error) {
			err = cr.Scan(&r.key, (*zeronull.Text)(&r.id), &r.payload) // a NULL aggregate id is ""
			return r, err
		})
		return err
	})
	return rows, err
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
		return &badQuery{fmt.Errorf("subscriber %s: the backfill's query (the declaration's table %s, its expressions, and --where %q) fails: %w",
			b.name, b.bf.Table, b.opts.Where, err)}
	}
	return err
}

// badQuery is an error of the backfill's own SQL: not an outage.
type badQuery struct{ err error }

func (e *badQuery) Error() string { return e.err.Error() }
func (e *badQuery) Unwrap() error { return e.err }

// errChunkAgain: the chunk is to be read and handled again (after a
// failure the handler may get over, or another process moved the
// backfill on).
var errChunkAgain = errors.New("handle the chunk again")

func (b *backfiller) event(r row) subscribers.Event {
	return subscribers.Event{
		Type: b.bf.EventType, AggregateType: b.bf.AggregateType, AggregateID: r.id,
		Payload:   r.payload,
		Headers:   nats.Header{subscribers.BackfillHeader: []string{b.bf.Table + ":" + strconv.FormatInt(r.key, 10)}},
		CreatedAt: time.Now(), Delivery: uint64(b.failureCount(r.key)) + 1,
	}
}

func (b *backfiller) failureCount(key int64) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.failures[key]
}

// judge settles the handler's failure on a row as the live runtime judges
// it: an outage is waited out (outage is the error to return); a permanent
// failure, or the one that reaches max_failures, makes the row dead (its
// failure row, with the reason); any other has the chunk handled again
// (again), counted towards max_failures if it is the handler's own.
func (b *backfiller) judge(ctx context.Context, key int64, err error, dead map[int64]string) (again bool, outage error) {
	switch b.health.Judge(ctx, err) {
	case subscribers.OutcomeAbandoned, subscribers.OutcomeOutage:
		return false, b.wrapOutage(ctx, err)
	case subscribers.OutcomePermanent:
		dead[key] = err.Error()
		return false, nil
	case subscribers.OutcomeSnooze, subscribers.OutcomeRetry:
		return true, nil // not the row's fault (a conflict, a snooze): uncounted
	}
	b.mu.Lock()
	b.failures[key]++
	n := b.failures[key]
	b.mu.Unlock()
	if n >= b.opts.Config.MaxFailures {
		dead[key] = fmt.Sprintf("gave up after %d failures (subscribers.max_failures): %v", n, err)
		return false, nil
	}
	b.logger.Warn("backfill row failed, will retry", "key", key, "failures", n, "error", err)
	return true, nil
}

// apply hands a chunk to the handler and moves the segment's checkpoint
// past it, in one transaction.
func (b *backfiller) apply(ctx context.Context, sg *segment, rows []row) error {
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
	locked, err := bookkeeping.New(tx).BackfillSegmentLock(actx, bookkeeping.BackfillSegmentParams{Subscriber: b.name, Segment: sg.N})
	if err != nil {
		return fmt.Errorf("lock the backfill's segment %d: %w", sg.N, err)
	}
	if locked.Last != sg.Last || !locked.StartedAt.Equal(b.snapshot().StartedAt) || locked.Paused {
		return b.reload(sg, locked.Last, locked.StartedAt, locked.Paused)
	}
	evs := make([]subscribers.Event, len(rows))
	for i, r := range rows {
		evs[i] = b.event(r)
	}
	dead := map[int64]string{}
	var failed bool
	if th, ok := b.opts.Handler.TxHandler(); ok {
		failed, err = b.applyTx(actx, tx, th, rows, evs, dead)
	} else {
		eh, _ := b.opts.Handler.EventHandler()
		failed, err = b.applyEach(actx, eh, rows, evs, dead)
	}
	if err != nil {
		return err
	}
	if !failed {
		b.health.HandlerWorked()
		return b.commit(ctx, actx, tx, sg, rows, dead)
	}
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
	case <-time.After(b.opts.Config.Backoff(uint64(n))):
	}
	return errChunkAgain
}

// commit records the chunk's failed rows, moves its segment's checkpoint
// past it and commits, with the chunk's effects when tx holds them.
func (b *backfiller) commit(ctx, actx context.Context, tx pgx.Tx, sg *segment, rows []row, dead map[int64]string) error {
	for key, reason := range dead {
		if err := bookkeeping.New(tx).BackfillFailureRecord(actx, bookkeeping.BackfillFailureRecordParams{Subscriber: b.name, Key: key, Reason: reason}); err != nil {
			return fmt.Errorf("record backfill failure: %w", err)
		}
		b.logger.Error("backfill row failed", "key", key, "reason", reason)
	}
	newLast := sg.To
	if len(rows) == b.chunk {
		newLast = rows[len(rows)-1].key
	}
	applied := int64(len(rows) - len(dead))
	if apart := b.opts.Hooks.CheckpointApart; apart > 0 {
		if err := tx.Commit(actx); err != nil {
			return err
		}
		time.Sleep(apart)
		var err error
		if tx, err = b.opts.Pool.Begin(actx); err != nil {
			return err
		}
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	}
	moved, err := bookkeeping.New(tx).BackfillSegmentAdvance(actx, bookkeeping.BackfillSegmentAdvanceParams{
		Subscriber: b.name, Segment: sg.N, LastKey: newLast, Done: applied, Failed: int64(len(dead))})
	if err != nil {
		return fmt.Errorf("advance the backfill: %w", err)
	}
	if !moved {
		// Paused while the chunk applied: undone, and done on resume.
		return b.reload(sg, sg.Last, b.snapshot().StartedAt, true)
	}
	if err := tx.Commit(actx); err != nil {
		return fmt.Errorf("commit the chunk: %w", err)
	}
	sg.Last = newLast
	b.mu.Lock()
	for _, r := range rows {
		delete(b.failures, r.key)
	}
	b.status.Done += applied
	b.status.Failed += int64(len(dead))
	b.status.UpdatedAt = time.Now()
	if newLast >= sg.To {
		b.status.SegmentsDone++
	}
	b.mu.Unlock()
	return nil
}

// reload takes the segment as another process (or an operator's pause)
// left it.
func (b *backfiller) reload(sg *segment, last int64, started time.Time, paused bool) error {
	if !started.Equal(b.snapshot().StartedAt) {
		return fmt.Errorf("subscriber %s: its backfill was restarted elsewhere", b.name)
	}
	sg.Last = last
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
func (b *backfiller) applyTx(ctx context.Context, tx pgx.Tx, th subscribers.TxHandler, rows []row, evs []subscribers.Event, dead map[int64]string) (failed bool, err error) {
	if bh, ok := th.(subscribers.BatchTxHandler); ok && len(rows) > 1 {
		err := inSavepoint(ctx, tx, func(tx pgx.Tx) (err error) {
			defer subscribers.RecoverHandler(evs[0], &err)
			return bh.HandleBatchTx(ctx, tx, evs)
		})
		if err == nil {
			return false, nil
		}
		if dep, ok := subscribers.IsUnavailable(err); ok {
			b.health.MarkDown(dep, err)
		}
		if ctx.Err() != nil || b.health.ProbeAll(ctx) {
			return false, b.wrapOutage(ctx, err)
		}
		// Row by row, where each row's error is its own verdict.
	}
	for i, r := range rows {
		ev := evs[i]
		err := inSavepoint(ctx, tx, func(tx pgx.Tx) (err error) {
			defer subscribers.RecoverHandler(ev, &err)
			return th.HandleTx(ctx, tx, ev)
		})
		if err == nil {
			continue
		}
		again, err := b.judge(ctx, r.key, err, dead)
		if err != nil {
			return false, err
		}
		failed = failed || again
	}
	return failed, nil
}

// applyEach hands the chunk to a handler whose effects live outside
// Postgres: it is idempotent, so a chunk handled again after a crash does
// no harm.
func (b *backfiller) applyEach(ctx context.Context, eh subscribers.EventHandler, rows []row, evs []subscribers.Event, dead map[int64]string) (failed bool, err error) {
	errs := make([]error, len(evs))
	if bh, ok := eh.(subscribers.BatchEventHandler); ok && len(evs) > 1 {
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
				defer subscribers.RecoverHandler(ev, &errs[i])
				errs[i] = eh.Handle(ctx, ev)
			}()
		}
	}
	for i, err := range errs {
		if err == nil {
			continue
		}
		again, err := b.judge(ctx, rows[i].key, err, dead)
		if err != nil {
			return false, err
		}
		failed = failed || again
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
	if !b.health.WaitUp(ctx) {
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
