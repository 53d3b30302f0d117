package outbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Unnumbered returns the event types the outbox does not number (no
// aggregate_seq, so no per-aggregate order), sorted; none by default. See
// SetNumbering.
//
// The list is read from the numbering trigger's arguments in pg_trigger,
// which every role may read: an ordered subscriber checks it with no grant.
func (s *Store) Unnumbered(ctx context.Context) ([]string, error) { return Unnumbered(ctx, s.pool) }

// Unnumbered is Store.Unnumbered on q (a pool, a connection or a
// transaction).
func Unnumbered(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) ([]string, error) {
	var n int16
	var args []byte
	err := q.QueryRow(ctx, `
SELECT tgnargs, tgargs FROM pg_trigger
WHERE tgrelid = 'outbox'::regclass AND tgname = 'outbox_sequence'`).Scan(&n, &args)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errors.New("the outbox has no numbering trigger (outbox_sequence, migration 00009): run fanout migrate")
	}
	if err != nil {
		return nil, fmt.Errorf("read the outbox's numbering: %w", err)
	}
	// tgargs holds each argument followed by a NUL byte.
	types := make([]string, 0, n)
	for _, a := range bytes.Split(args, []byte{0})[:n] {
		types = append(types, string(a))
	}
	slices.Sort(types)
	return types, nil
}

// SetNumbering makes the outbox number every event except those whose
// type is in skip, from the next insert on; with skip empty, every event,
// as a new database does. A skipped type's events get no aggregate_seq:
// the relays publish them without Fanout-Aggregate-Seq, outside their
// aggregate's order, and relay.on_failed hold does not hold behind them.
// In exchange, each insert skips the numbering trigger: about 8 points
// of a writer's transactions per second (docs/benchmarks.md).
//
// It makes the trigger again, so it needs the outbox's owner (the migrate
// role); writers wait for it a moment. Each type must be a valid event
// type (ValidEventType). Whether an ordered subscriber reads a type is
// the caller's to check (fanout outbox numbering does, for the
// subscribers it knows); an ordered subscriber that reads a skipped type
// refuses to start.
func (s *Store) SetNumbering(ctx context.Context, skip []string) error {
	for _, t := range skip {
		if err := ValidEventType(t); err != nil {
			return err
		}
	}
	if skip == nil {
		skip = []string{}
	}
	// The function locks the outbox and its ranges for its DDL, for at
	// most a second: against writers and relays at work it may deadlock
	// or time out, and tries again.
	wait := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		_, err := s.pool.Exec(ctx, `SELECT fanout_outbox_numbering($1)`, skip)
		var pgErr *pgconn.PgError
		busy := errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "55P03") // deadlock_detected, lock_not_available
		if err == nil || !busy || attempt == 10 {
			if err != nil {
				return fmt.Errorf("set the outbox's numbering: %w", err)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("set the outbox's numbering: %w", err)
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Second)
	}
}
