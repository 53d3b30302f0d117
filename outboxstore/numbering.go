package outboxstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Unnumbered returns the event types the outbox does not number (no
// aggregate_seq, so no per-aggregate order), sorted; none by default. See
// SetNumbering.
//
// The list is read from the numbering trigger's arguments in pg_trigger,
// which every role may read: an ordered subscriber checks it with no grant.
func (s *Store) Unnumbered(ctx context.Context) ([]string, error) {
	return outbox.Unnumbered(ctx, s.pool)
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
		if err := outbox.ValidEventType(t); err != nil {
			return err
		}
	}
	if skip == nil {
		skip = []string{}
	}
	// The function locks the outbox and its ranges for its DDL, each lock
	// waited for at most 200 ms (writers queue behind the wait): against
	// writers and relays at work it may deadlock or time out, and tries
	// again, for about half a minute.
	wait := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		_, err := s.pool.Exec(ctx, `SELECT fanout_outbox_numbering($1)`, skip)
		var pgErr *pgconn.PgError
		busy := errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "55P03") // deadlock_detected, lock_not_available
		switch {
		case err == nil:
			return nil
		case !busy:
			return fmt.Errorf("set the outbox's numbering: %w", err)
		case attempt == numberingAttempts:
			return fmt.Errorf("set the outbox's numbering: the outbox stayed locked through %d tries (%w); %s",
				attempt, err, s.outboxLockHolders(ctx))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("set the outbox's numbering: %w (last try: %w)", ctx.Err(), err)
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// numberingAttempts is how often SetNumbering tries before it gives up.
const numberingAttempts = 30

// outboxLockHolders says which other sessions hold locks on the outbox or
// its ranges, for an error: the transactions to end first.
func (s *Store) outboxLockHolders(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	rows, err := s.pool.Query(ctx, `
SELECT DISTINCT a.pid, coalesce(a.usename, ''), coalesce(a.application_name, ''),
       coalesce(extract(epoch FROM now() - a.xact_start), 0)::int
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND a.pid <> pg_backend_pid()
  AND l.relation IN (SELECT 'outbox'::regclass UNION ALL SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox'::regclass)
ORDER BY 4 DESC LIMIT 5`)
	if err != nil {
		return "the sessions holding it could not be read: " + err.Error()
	}
	var holders []string
	var pid, secs int
	var user, app string
	_, err = pgx.ForEachRow(rows, []any{&pid, &user, &app, &secs}, func() error {
		holders = append(holders, fmt.Sprintf("pid %d (role %s, application %q, in a transaction for %d s)", pid, user, app, secs))
		return nil
	})
	if err != nil || len(holders) == 0 {
		return "no session holds it now: try again"
	}
	return "held by " + strings.Join(holders, ", ") + ": end those transactions, or try when writers are fewer"
}
