package outbox

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Database names a Postgres database the world over: its cluster's system
// identifier and its name, read live, so that a copy (CREATE DATABASE ...
// TEMPLATE, a dump restored elsewhere) is another database. It is what a
// stream records as its owner.
type Database struct {
	System uint64
	Name   string
}

// String is "<system identifier>/<name>", the name path-escaped so that the
// string holds no '/' but the separators, and nothing a header cannot carry.
func (d Database) String() string {
	return strconv.FormatUint(d.System, 10) + "/" + url.PathEscape(d.Name)
}

// Origin is where an event comes from: a database and an epoch of its
// outbox. A restore that rewinds the outbox's ids starts a new epoch, so the
// events the restored database writes are not taken for the lost events
// that had the same ids.
type Origin struct {
	Database Database
	Epoch    int
}

// String is "<system identifier>/<database>/<epoch>", the Fanout-Origin header.
func (o Origin) String() string {
	return o.Database.String() + "/" + strconv.Itoa(o.Epoch)
}

// ParseOrigin reads a Fanout-Origin header value.
func ParseOrigin(s string) (Origin, error) {
	parts := strings.Split(s, "/")
	if len(parts) != 3 {
		return Origin{}, fmt.Errorf("origin %q is not <system identifier>/<database>/<epoch>", s)
	}
	sys, err := strconv.ParseUint(parts[0], 10, 64)
	if err != nil {
		return Origin{}, fmt.Errorf("origin %q: system identifier: %w", s, err)
	}
	name, err := url.PathUnescape(parts[1])
	if err != nil || name == "" {
		return Origin{}, fmt.Errorf("origin %q: database name is not path-escaped", s)
	}
	epoch, err := strconv.Atoi(parts[2])
	if err != nil || epoch < 1 {
		return Origin{}, fmt.Errorf("origin %q: epoch is not a number from 1", s)
	}
	return Origin{Database: Database{System: sys, Name: name}, Epoch: epoch}, nil
}

// Epoch is one epoch of the outbox: the rows from FirstID on, up to the
// next epoch's first id.
type Epoch struct {
	N       int   `json:"epoch"`
	FirstID int64 `json:"first_id"`
}

// Identity is a database's identity and its outbox's epochs: what every
// event it writes is known by.
type Identity struct {
	Database Database
	Epochs   []Epoch // by FirstID, ascending; never empty
	origins  []string
}

// NewIdentity returns the identity of db with the given epochs (at least one).
func NewIdentity(db Database, epochs []Epoch) (*Identity, error) {
	if len(epochs) == 0 {
		return nil, errors.New("outbox_epochs is empty: run fanout migrate")
	}
	sort.Slice(epochs, func(i, j int) bool { return epochs[i].FirstID < epochs[j].FirstID })
	id := &Identity{Database: db, Epochs: epochs, origins: make([]string, len(epochs))}
	for i, e := range epochs {
		id.origins[i] = Origin{Database: db, Epoch: e.N}.String()
	}
	return id, nil
}

// index is the position in Epochs of the epoch the row id belongs to.
func (id *Identity) index(rowID int64) int {
	i := sort.Search(len(id.Epochs), func(i int) bool { return id.Epochs[i].FirstID > rowID })
	return max(i-1, 0)
}

// EpochOf is the epoch of the outbox row rowID.
func (id *Identity) EpochOf(rowID int64) int { return id.Epochs[id.index(rowID)].N }

// OriginOf is the Fanout-Origin of the outbox row rowID.
func (id *Identity) OriginOf(rowID int64) string { return id.origins[id.index(rowID)] }

// Latest is the current epoch.
func (id *Identity) Latest() Epoch { return id.Epochs[len(id.Epochs)-1] }

// ReadDatabase reads the identity of the database q is connected to.
func ReadDatabase(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (Database, error) {
	var d Database
	var sys int64
	if err := q.QueryRow(ctx, `SELECT system_identifier, current_database() FROM pg_control_system()`).Scan(&sys, &d.Name); err != nil {
		return Database{}, fmt.Errorf("read the database's identity: %w", err)
	}
	d.System = uint64(sys)
	return d, nil
}

// ReadIdentity reads the database's identity and its outbox's epochs.
func (s *Store) ReadIdentity(ctx context.Context) (*Identity, error) {
	db, err := ReadDatabase(ctx, s.pool)
	if err != nil {
		return nil, err
	}
	rows, err := s.pool.Query(ctx, `SELECT epoch, first_id FROM outbox_epochs ORDER BY first_id`)
	if err != nil {
		return nil, fmt.Errorf("read the outbox's epochs: %w", err)
	}
	epochs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Epoch, error) {
		var e Epoch
		return e, r.Scan(&e.N, &e.FirstID)
	})
	if err != nil {
		return nil, fmt.Errorf("read the outbox's epochs: %w", err)
	}
	return NewIdentity(db, epochs)
}

// State is the outbox's identity and the last id it handed out, read
// together (fanout_outbox_state): an epoch another relay is beginning is
// either in Identity or not yet reflected in LastID.
func (s *Store) State(ctx context.Context) (*Identity, int64, error) {
	db, err := ReadDatabase(ctx, s.pool)
	if err != nil {
		return nil, 0, err
	}
	var lastID int64
	var epochs []Epoch
	if err := s.pool.QueryRow(ctx, `SELECT last_id, epochs FROM fanout_outbox_state()`).Scan(&lastID, &epochs); err != nil {
		return nil, 0, fmt.Errorf("read the outbox's epochs and last id: %w", err)
	}
	ident, err := NewIdentity(db, epochs)
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
