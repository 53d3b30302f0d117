package searchindex

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrBusy is returned by Lock while another command holds it.
var ErrBusy = errors.New("another fanout reindex, reindex rollback, reindex cleanup or reindex --check --repair is running")

// lockClass namespaces fanout's advisory locks (the second key is the
// alias's hash).
const lockClass = 0x66616e // "fan"

// Lock serializes the commands that create, delete or swap index versions
// of one alias: a cleanup during a reindex would delete the index being
// loaded, and two reindexes would share the replay consumer. It holds a
// Postgres session advisory lock on a connection of its own, so a command
// that dies releases it with its connection. unlock closes that connection.
// Session advisory locks need a session: behind PgBouncer in transaction
// pooling mode, point postgres.url at Postgres itself for these commands.
func Lock(ctx context.Context, pool *pgxpool.Pool, alias string) (unlock func(), err error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	var locked bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1::int, hashtext($2))`, lockClass, alias).Scan(&locked); err != nil {
		conn.Release()
		return nil, fmt.Errorf("take the reindex lock: %w", err)
	}
	if !locked {
		// Name the holder, so an operator can tell a running command from
		// a session left behind (pg_stat_activity, pg_terminate_backend).
		var holders string
		_ = conn.QueryRow(ctx, `
SELECT coalesce(string_agg(pid::text, ', '), 'unknown') FROM pg_locks
WHERE locktype = 'advisory' AND granted AND classid = $1::int::oid
  AND objid = (hashtext($2)::bigint & 4294967295)::oid AND objsubid = 2`, lockClass, alias).Scan(&holders)
		conn.Release()
		return nil, fmt.Errorf("%w on alias %s: Postgres backend %s holds its advisory lock; run again once it has ended", ErrBusy, alias, holders)
	}
	// The connection leaves the pool: closing it is the unlock, and no
	// other caller can be handed a connection that holds the lock.
	held := conn.Hijack()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// Unlocked before the close returns: a backend releases its locks
		// when it exits, a moment after its client has gone, and a command
		// run right after this one (a cleanup after a reindex) would find
		// the lock still held. Closing alone still releases it if the
		// unlock fails.
		_, _ = held.Exec(ctx, `SELECT pg_advisory_unlock($1::int, hashtext($2))`, lockClass, alias)
		_ = held.Close(ctx)
	}, nil
}
