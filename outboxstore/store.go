package outboxstore

import (
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Store is the outbox's queries over one pool (see the package doc for
// which are where).
type Store struct {
	pool *pgxpool.Pool
	// OnFailed says whether a failed row holds its aggregate's later
	// events (HoldFailed, the default) or lets them pass (SkipFailed). Set
	// it before the Store is used.
	OnFailed OnFailed
	// Unordered claims without per-aggregate order, for the self-test of
	// the checkers that must catch events out of order (internal/testhooks).
	Unordered bool
}

// OnFailed is what a failed row does to the later events of its aggregate
// (relay.on_failed).
type OnFailed string

const (
	// HoldFailed keeps an aggregate's later events unpublished while an
	// earlier one is failed, until an operator returns it (outbox
	// retry-failed) or skips it (outbox skip).
	HoldFailed OnFailed = "hold"
	// SkipFailed publishes an aggregate's later events past a failed one.
	SkipFailed OnFailed = "skip"
)

// New returns the outbox queries over pool.
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

// HeldBehindPrefix starts the last error of a row a wal relay marked
// failed because an earlier event of its aggregate failed (relay.on_failed
// hold): "held behind event <id>, ...". A poll relay leaves such rows
// pending; its claim passes them over.
const HeldBehindPrefix = "held behind event "

// HeldBehindReason is the last error of a row held behind the failed
// event failedID.
func HeldBehindReason(failedID int64) string {
	return HeldBehindPrefix + strconv.FormatInt(failedID, 10) + ", an earlier event of its aggregate that failed (relay.on_failed hold): " +
		"fanout outbox retry-failed or fanout outbox skip releases it"
}
