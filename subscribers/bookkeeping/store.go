// Package bookkeeping is the store of the subscribers' own tables: the
// checkpoint (processed_events), the attempts on redelivered events
// (subscriber_attempts), the ordered subscribers' per-aggregate checkpoint
// (subscriber_aggregates), the dead letters each subscriber vouches for
// (dead_letters), the numbers of event origins (event_origins), the
// backfills' progress (subscriber_backfills, subscriber_backfill_segments,
// subscriber_backfill_failures) and the replay requests (replays, through
// Replays). Their schema is in schema/migrations.
//
// Every statement on those tables is a constant in this package, beside
// the method that runs it (river's riverdriver: an <Entity><Verb> method
// per query, its arguments in a params struct). The subscriber runtime,
// the backfill, the operator tools and the test kit all go through Store;
// what the rows mean (when an event has had enough, whose turn it is) is
// theirs to decide. Errors are Postgres's, unwrapped: the caller says what
// it was doing.
package bookkeeping

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is what a Store runs its statements on: a pool, a connection, or a
// transaction (the checkpoint of a TxHandler's batch commits with its
// effects, in the runtime's transaction).
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Store runs the bookkeeping statements on one DB. It is a small value:
// make one per transaction with New(tx).
type Store struct{ db DB }

// New returns the store of db.
func New(db DB) Store { return Store{db: db} }

// accessCheckSQL are the statements a subscriber's start runs (and rolls
// back) to learn whether its role may use its rows: each fails with
// insufficient_privilege (or undefined_table before `fanout migrate`).
var accessCheckSQL = [...]string{
	`SELECT num FROM event_origins LIMIT 0`,
	`SELECT has_function_privilege('fanout_origin_number(text)', 'EXECUTE')`,
	`INSERT INTO processed_events (subscriber, event_id) VALUES ($1, -1) ON CONFLICT DO NOTHING`,
	`INSERT INTO subscriber_attempts (subscriber, event_id) VALUES ($1, -1) ON CONFLICT DO NOTHING`,
}

// AccessCheckParams names the subscriber whose rows are checked.
type AccessCheckParams struct{ Subscriber string }

// AccessCheck writes and reads a row of each table the subscriber's
// runtime uses, under its name, and takes its replays (holding one until
// the rollback), in one round trip: run it in a transaction that is rolled
// back. An error is Postgres's refusal (a
// missing grant or table, a *pgconn.PgError) or its absence.
func (s Store) AccessCheck(ctx context.Context, p AccessCheckParams) error {
	b := &pgx.Batch{}
	b.Queue(accessCheckSQL[0])
	b.Queue(accessCheckSQL[1]).QueryRow(func(row pgx.Row) error {
		var ok bool
		if err := row.Scan(&ok); err != nil {
			return err
		}
		if !ok {
			return &pgconn.PgError{Code: "42501", Message: "permission denied for function fanout_origin_number"}
		}
		return nil
	})
	b.Queue(accessCheckSQL[2], p.Subscriber)
	b.Queue(accessCheckSQL[3], p.Subscriber)
	b.Queue(deadLetterVouchSQL, p.Subscriber, -1, -1, []byte{})
	b.Queue(attemptListSQL, p.Subscriber, []int64{-1})
	b.Queue(replayTakeSQL, p.Subscriber)
	return s.db.SendBatch(ctx, b).Close()
}

// exec runs a statement whose only answer is its error.
func (s Store) exec(ctx context.Context, sql string, args ...any) error {
	_, err := s.db.Exec(ctx, sql, args...)
	return err
}

// affected runs a statement and reports whether it changed any row.
func (s Store) affected(ctx context.Context, sql string, args ...any) (bool, error) {
	ct, err := s.db.Exec(ctx, sql, args...)
	return err == nil && ct.RowsAffected() > 0, err
}

// collect runs a query and gathers its rows with to.
func collect[T any](ctx context.Context, db DB, to pgx.RowToFunc[T], sql string, args ...any) ([]T, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, to)
}

// countBySubscriber runs a query of (subscriber, count) rows.
func (s Store) countBySubscriber(ctx context.Context, sql string) (map[string]int64, error) {
	rows, err := s.db.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	counts := map[string]int64{}
	var name string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&name, &n}, func() error {
		counts[name] = n
		return nil
	})
	return counts, err
}

// IsUndefinedTable reports whether err is Postgres saying a table does not
// exist (a database `fanout migrate` has not brought up to date).
func IsUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}
