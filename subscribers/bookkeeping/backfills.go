package bookkeeping

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements on the backfills' progress: subscriber_backfills (one row
// per subscriber: its backfill's --where, counts and state),
// subscriber_backfill_segments (the parts of its key range read side by
// side, each with its checkpoint, last_key) and
// subscriber_backfill_failures (the rows it could not apply).
const (
	backfillStatusSQL = `SELECT b.subscriber, b.where_sql, b.high_key, b.total_rows, b.done_rows, b.failed_rows, b.paused,
       b.started_at, b.updated_at, b.finished_at,
       (SELECT count(*) FROM subscriber_backfill_segments s WHERE s.subscriber = b.subscriber),
       (SELECT count(*) FROM subscriber_backfill_segments s WHERE s.subscriber = b.subscriber AND s.last_key >= s.to_key)
FROM subscriber_backfills b`

	backfillStartSQL = `
INSERT INTO subscriber_backfills AS b (subscriber, where_sql, high_key, total_rows)
VALUES ($1, $2, $3, $4)
ON CONFLICT (subscriber) DO UPDATE
SET where_sql = excluded.where_sql, high_key = excluded.high_key, total_rows = excluded.total_rows,
    done_rows = 0, failed_rows = 0, paused = false, started_at = now(), updated_at = now(), finished_at = NULL`

	backfillSegmentClearSQL = `DELETE FROM subscriber_backfill_segments WHERE subscriber = $1`

	backfillSegmentAddSQL = `INSERT INTO subscriber_backfill_segments (subscriber, segment, from_key, to_key, last_key) VALUES ($1, $2, $3, $4, $3)`

	backfillSegmentListSQL = `SELECT segment, to_key, last_key FROM subscriber_backfill_segments WHERE subscriber = $1 ORDER BY segment`

	backfillFailureClearSQL = `DELETE FROM subscriber_backfill_failures WHERE subscriber = $1`

	// backfillSegmentLockSQL fences a chunk: another process running the
	// same backfill, or a restart, moved the segment on if last_key or
	// started_at differ.
	backfillSegmentLockSQL = `
SELECT s.last_key, b.started_at, b.paused
FROM subscriber_backfill_segments s JOIN subscriber_backfills b USING (subscriber)
WHERE s.subscriber = $1 AND s.segment = $2
FOR UPDATE OF s`

	// backfillSegmentAdvanceSQL moves the segment's checkpoint and counts
	// the chunk's rows, last in a chunk's transaction: the lock on the
	// backfill's row, which every worker's chunk takes, is held only to
	// the commit. It matches no row once the backfill is paused, even by a
	// pause committed after the chunk began (the row is read again after
	// its lock): the chunk is then rolled back, so no chunk commits after
	// a pause has.
	backfillSegmentAdvanceSQL = `
WITH segment AS (
    UPDATE subscriber_backfill_segments SET last_key = $3 WHERE subscriber = $1 AND segment = $2
)
UPDATE subscriber_backfills SET done_rows = done_rows + $4, failed_rows = failed_rows + $5, updated_at = now()
WHERE subscriber = $1 AND NOT paused`

	backfillFinishSQL = `
UPDATE subscriber_backfills SET finished_at = now(), updated_at = now()
WHERE subscriber = $1 AND started_at = $2 AND finished_at IS NULL
  AND NOT EXISTS (SELECT FROM subscriber_backfill_segments s WHERE s.subscriber = $1 AND s.last_key < s.to_key)`

	backfillFailureRecordSQL = `
INSERT INTO subscriber_backfill_failures (subscriber, row_key, reason) VALUES ($1, $2, $3)
ON CONFLICT (subscriber, row_key) DO UPDATE SET reason = excluded.reason, failed_at = now()`

	backfillFailureListSQL = `SELECT row_key, reason, failed_at FROM subscriber_backfill_failures WHERE subscriber = $1 ORDER BY row_key`

	backfillPauseSQL = `UPDATE subscriber_backfills SET paused = $2, updated_at = now() WHERE subscriber = $1 AND finished_at IS NULL`
)

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

func scanBackfill(row pgx.CollectableRow) (BackfillStatus, error) {
	var s BackfillStatus
	err := row.Scan(&s.Subscriber, &s.Where, &s.HighKey, &s.Total, &s.Done, &s.Failed, &s.Paused,
		&s.StartedAt, &s.UpdatedAt, &s.FinishedAt, &s.Segments, &s.SegmentsDone)
	return s, err
}

// BackfillList returns every subscriber's backfill, running or finished,
// by subscriber.
func (s Store) BackfillList(ctx context.Context) ([]BackfillStatus, error) {
	return collect(ctx, s.db, scanBackfill, backfillStatusSQL+` ORDER BY b.subscriber`)
}

// BackfillGet returns the subscriber's backfill; ok is false if it never
// had one.
func (s Store) BackfillGet(ctx context.Context, subscriber string) (b BackfillStatus, ok bool, err error) {
	rows, err := s.db.Query(ctx, backfillStatusSQL+` WHERE b.subscriber = $1`, subscriber)
	if err != nil {
		return b, false, err
	}
	b, err = pgx.CollectExactlyOneRow(rows, scanBackfill)
	if errors.Is(err, pgx.ErrNoRows) {
		return b, false, nil
	}
	return b, err == nil, err
}

// BackfillStartParams is a backfill starting (over): its --where, the
// greatest key it reads up to, its rows, and its segments' key ranges
// (from, to].
type BackfillStartParams struct {
	Subscriber string
	Where      string
	HighKey    int64
	Total      int64
	Segments   [][2]int64
}

// BackfillStart records a backfill that starts, over the last one (its
// segments and failures cleared), in one transaction: run it on a pool,
// or in a transaction of the caller's.
func (s Store) BackfillStart(ctx context.Context, p BackfillStartParams) error {
	return pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, backfillStartSQL, p.Subscriber, p.Where, p.HighKey, p.Total); err != nil {
			return fmt.Errorf("record the backfill in subscriber_backfills: %w", err)
		}
		for _, sql := range []string{backfillSegmentClearSQL, backfillFailureClearSQL} {
			if _, err := tx.Exec(ctx, sql, p.Subscriber); err != nil {
				return fmt.Errorf("clear the last backfill: %w", err)
			}
		}
		for i, r := range p.Segments {
			if _, err := tx.Exec(ctx, backfillSegmentAddSQL, p.Subscriber, i, r[0], r[1]); err != nil {
				return fmt.Errorf("record the backfill's segments: %w", err)
			}
		}
		return nil
	})
}

// BackfillSegment is one worker's part of a backfill's key range: the keys
// after Last up to To are left.
type BackfillSegment struct {
	N        int
	To, Last int64
}

// BackfillSegmentList returns the subscriber's backfill segments, in
// order.
func (s Store) BackfillSegmentList(ctx context.Context, subscriber string) ([]BackfillSegment, error) {
	return collect(ctx, s.db, pgx.RowToStructByPos[BackfillSegment], backfillSegmentListSQL, subscriber)
}

// BackfillSegmentParams names one segment of a subscriber's backfill.
type BackfillSegmentParams struct {
	Subscriber string
	Segment    int
}

// BackfillSegmentLocked is a segment as its chunk's transaction locked it.
type BackfillSegmentLocked struct {
	Last      int64
	StartedAt time.Time // its backfill's start: another means a restart
	Paused    bool
}

// BackfillSegmentLock locks the segment's row in the chunk's transaction
// and reads it with its backfill's state.
func (s Store) BackfillSegmentLock(ctx context.Context, p BackfillSegmentParams) (BackfillSegmentLocked, error) {
	var l BackfillSegmentLocked
	err := s.db.QueryRow(ctx, backfillSegmentLockSQL, p.Subscriber, p.Segment).Scan(&l.Last, &l.StartedAt, &l.Paused)
	return l, err
}

// BackfillSegmentAdvanceParams is a chunk applied: the segment's new last
// key and the rows it applied and failed.
type BackfillSegmentAdvanceParams struct {
	Subscriber   string
	Segment      int
	LastKey      int64
	Done, Failed int64
}

// BackfillSegmentAdvance moves the segment's checkpoint and counts the
// chunk's rows, last in the chunk's transaction. It reports false, and
// changes nothing, if the backfill is paused.
func (s Store) BackfillSegmentAdvance(ctx context.Context, p BackfillSegmentAdvanceParams) (bool, error) {
	return s.affected(ctx, backfillSegmentAdvanceSQL, p.Subscriber, p.Segment, p.LastKey, p.Done, p.Failed)
}

// BackfillFinishParams names the backfill that started at StartedAt.
type BackfillFinishParams struct {
	Subscriber string
	StartedAt  time.Time
}

// BackfillFinish marks the backfill finished if every segment is (and it
// was not restarted since StartedAt).
func (s Store) BackfillFinish(ctx context.Context, p BackfillFinishParams) error {
	return s.exec(ctx, backfillFinishSQL, p.Subscriber, p.StartedAt)
}

// BackfillPauseParams pauses (or resumes) a subscriber's backfill.
type BackfillPauseParams struct {
	Subscriber string
	Paused     bool
}

// BackfillPause pauses or resumes the subscriber's unfinished backfill and
// reports whether it has one.
func (s Store) BackfillPause(ctx context.Context, p BackfillPauseParams) (bool, error) {
	return s.affected(ctx, backfillPauseSQL, p.Subscriber, p.Paused)
}

// BackfillFailure is a row the backfill could not apply: its dead letter.
type BackfillFailure struct {
	Key      int64
	Reason   string
	FailedAt time.Time
}

// BackfillFailureRecordParams is a row the backfill gave up on.
type BackfillFailureRecordParams struct {
	Subscriber string
	Key        int64
	Reason     string
}

// BackfillFailureRecord records (or records again) a row the backfill
// could not apply, in its chunk's transaction.
func (s Store) BackfillFailureRecord(ctx context.Context, p BackfillFailureRecordParams) error {
	return s.exec(ctx, backfillFailureRecordSQL, p.Subscriber, p.Key, p.Reason)
}

// BackfillFailureList returns the rows the subscriber's backfill could not
// apply, by key.
func (s Store) BackfillFailureList(ctx context.Context, subscriber string) ([]BackfillFailure, error) {
	return collect(ctx, s.db, pgx.RowToStructByPos[BackfillFailure], backfillFailureListSQL, subscriber)
}
