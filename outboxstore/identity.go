package outboxstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
)

// ReadIdentity reads the database's identity and its outbox's epochs.
func (s *Store) ReadIdentity(ctx context.Context) (*outbox.Identity, error) {
	db, err := outbox.ReadDatabase(ctx, s.pool)
	if err != nil {
		return nil, err
	}
	rows, err := s.pool.Query(ctx, `SELECT epoch, first_id FROM outbox_epochs ORDER BY first_id`)
	if err != nil {
		return nil, fmt.Errorf("read the outbox's epochs: %w", err)
	}
	epochs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outbox.Epoch, error) {
		var e outbox.Epoch
		return e, r.Scan(&e.N, &e.FirstID)
	})
	if err != nil {
		return nil, fmt.Errorf("read the outbox's epochs: %w", err)
	}
	return outbox.NewIdentity(db, epochs)
}

// State is the outbox's identity and the last id it handed out, read
// together (fanout_outbox_state): an epoch another relay is beginning is
// either in Identity or not yet reflected in LastID.
func (s *Store) State(ctx context.Context) (*outbox.Identity, int64, error) {
	db, err := outbox.ReadDatabase(ctx, s.pool)
	if err != nil {
		return nil, 0, err
	}
	var lastID int64
	var epochs []outbox.Epoch
	if err := s.pool.QueryRow(ctx, `SELECT last_id, epochs FROM fanout_outbox_state()`).Scan(&lastID, &epochs); err != nil {
		return nil, 0, fmt.Errorf("read the outbox's epochs and last id: %w", err)
	}
	ident, err := outbox.NewIdentity(db, epochs)
	return ident, lastID, err
}

// RecentlyCreated says whether an event created at t (the database's
// clock) is younger than d: its row cannot have been dropped by a
// retention of d.
func (s *Store) RecentlyCreated(ctx context.Context, t time.Time, d time.Duration) (bool, error) {
	var recent bool
	if err := s.pool.QueryRow(ctx, `SELECT $1::timestamptz > now() - make_interval(secs => $2::float8)`, t, d.Seconds()).Scan(&recent); err != nil {
		return false, fmt.Errorf("compare an event's creation with the retention: %w", err)
	}
	return recent, nil
}

// PostgresStarted is when the database server last started: a restore, a
// failover and a restart each change it, with or without an error any
// query of the relay's saw.
func (s *Store) PostgresStarted(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := s.pool.QueryRow(ctx, `SELECT pg_postmaster_start_time()`).Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("read the server's start time: %w", err)
	}
	return t, nil
}

// LastID is the last id the outbox handed out (0 before the first).
func (s *Store) LastID(ctx context.Context) (int64, error) {
	var id int64
	if err := s.pool.QueryRow(ctx, `SELECT fanout_outbox_last_id()`).Scan(&id); err != nil {
		return 0, fmt.Errorf("read the outbox's last id: %w", err)
	}
	return id, nil
}

// RewoundFrom is the first id a restored database wrote, as far as its rows
// tell: after the newest row created no later than the newest event the
// stream holds of this database (created at created, id newestID), which
// the backup had; else its oldest row created after it; else the next id.
// It is above floor, the current epoch's first id.
func (s *Store) RewoundFrom(ctx context.Context, newestID int64, created time.Time, lastID, floor int64) (int64, error) {
	var id int64
	err := s.pool.QueryRow(ctx, `
SELECT greatest($4::bigint + 1, coalesce(
    (SELECT max(id) + 1 FROM outbox WHERE id <= $1 AND id >= $4 AND created_at <= $2),
    (SELECT min(id) FROM outbox WHERE id >= $4 AND created_at > $2),
    $3::bigint + 1))`, newestID, created, lastID, floor).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("find the first id the restored database wrote: %w", err)
	}
	return id, nil
}

// NewEpoch begins epoch after+1 at firstID (fanout_outbox_new_epoch), and
// moves the id sequence to at least past; it returns the latest epoch,
// which another relay may have begun first.
func (s *Store) NewEpoch(ctx context.Context, after, epoch int, firstID, past int64, reason string) (int, error) {
	var got int
	if err := s.pool.QueryRow(ctx, `SELECT fanout_outbox_new_epoch($1, $2, $3, $4, $5)`, after, epoch, firstID, past, reason).Scan(&got); err != nil {
		return 0, fmt.Errorf("begin outbox epoch %d at id %d: %w", epoch, firstID, err)
	}
	return got, nil
}

// AllowOrigin registers another database whose relays publish into the
// same stream (fanout_origin_allow): the subscribers number its events'
// origins only once it is. It reports whether it was new.
func (s *Store) AllowOrigin(ctx context.Context, d outbox.Database, reason string) (bool, error) {
	var added bool
	// As the origins name it: the name escaped (outbox.Database.String).
	_, name, _ := strings.Cut(d.String(), "/")
	if err := s.pool.QueryRow(ctx, `SELECT fanout_origin_allow($1, $2, $3)`, strconv.FormatUint(d.System, 10), name, reason).Scan(&added); err != nil {
		return false, fmt.Errorf("register database %d/%s: %w", d.System, d.Name, err)
	}
	return added, nil
}
