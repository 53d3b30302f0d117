package outbox

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sort"
	"strconv"
	"strings"

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
