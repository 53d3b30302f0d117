package stream

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// OwnerKey is the stream metadata key that records the database whose
// outbox the stream carries ("<system identifier>/<database>", as
// outbox.Database prints it), or SeveralDatabases for a stream that
// several databases share (stream.databases several).
const OwnerKey = "fanout.database"

// SeveralDatabases is OwnerKey's value for a stream shared by databases.
const SeveralDatabases = "several"

// ErrNoOwner is CheckOwner's error for a stream that records no owner
// (made before owners were recorded, or by `fanout provision` without
// stream.database).
var ErrNoOwner = errors.New("stream records no owning database")

// Owner is the owner a stream of this configuration records for the
// database db ("" when unknown): db, or SeveralDatabases.
func (s Config) Owner(db string) string {
	if s.Databases == SeveralDatabases {
		return SeveralDatabases
	}
	if s.Database != "" {
		return s.Database
	}
	return db
}

// CheckOwner says whether the relay of database db may publish into the
// stream: the stream must record db as its owner, or be shared by several
// databases, as the configuration says.
func CheckOwner(have jetstream.StreamConfig, cfg Config, db string) error {
	owner := have.Metadata[OwnerKey]
	switch {
	case owner == "":
		return fmt.Errorf("%w: stream %s has no metadata %s; set stream.database to %s (or stream.databases to several) and run fanout provision --update-stream %s",
			ErrNoOwner, have.Name, OwnerKey, db, have.Name)
	case owner == SeveralDatabases && cfg.Databases == SeveralDatabases:
		return nil
	case owner == SeveralDatabases:
		return fmt.Errorf("stream %s is shared by several databases (metadata %s=%s), but stream.databases is %q: set it to several for this relay to publish into it",
			have.Name, OwnerKey, owner, cfg.Databases)
	case owner != db:
		return fmt.Errorf("stream %s belongs to database %s (metadata %s), not to this relay's database %s: "+
			"its events would mix with another database's; give this database a stream of its own (stream.name, stream.subject_prefix), "+
			"or share one on purpose (stream.databases several, on every relay, and fanout provision --update-stream %s)",
			have.Name, owner, OwnerKey, db, have.Name)
	case cfg.Databases == SeveralDatabases:
		return fmt.Errorf("stream %s belongs to database %s alone (metadata %s), but stream.databases is several: run fanout provision --update-stream %s to share it",
			have.Name, owner, OwnerKey, have.Name)
	}
	return nil
}

// OwnerDifference is the difference in the owner a stream records, if want
// names one and have records another, or none.
func OwnerDifference(have, want jetstream.StreamConfig) (Difference, bool) {
	w, h := want.Metadata[OwnerKey], have.Metadata[OwnerKey]
	if w == "" || w == h {
		return Difference{}, false
	}
	return Difference{Field: "metadata " + OwnerKey, Have: h, Want: w}, true
}

// validDatabase says whether s looks like outbox.Database's String.
func validDatabase(s string) bool {
	sys, name, ok := strings.Cut(s, "/")
	if !ok || sys == "" || name == "" || strings.Contains(name, "/") {
		return false
	}
	_, err := strconv.ParseUint(sys, 10, 64)
	return err == nil
}
