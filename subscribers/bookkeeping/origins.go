package bookkeeping

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// The statements on event_origins (schema migration 00015), the numbers
// of the origins other than a database's own first epoch, and on
// dead_letters (00014), the letters each subscriber vouches for.
const (
	// originNumberSQL numbers an origin (fanout_origin_number): NULL when
	// every number is taken.
	originNumberSQL = `SELECT fanout_origin_number($1)`

	originGetSQL = `SELECT num FROM event_origins WHERE origin = $1`

	deadLetterVouchSQL = `INSERT INTO dead_letters (subscriber, stream_seq, event_id, digest) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING`
)

// OriginNumber returns the origin's number, giving it one if it has none;
// ok is false when every number is taken. An origin the function refuses
// is an error with code 22023 (invalid_parameter_value).
func (s Store) OriginNumber(ctx context.Context, origin string) (num int64, ok bool, err error) {
	var n pgtype.Int8
	err = s.db.QueryRow(ctx, originNumberSQL, origin).Scan(&n)
	return n.Int64, n.Valid, err
}

// OriginGet returns the origin's number; ok is false when it has none.
func (s Store) OriginGet(ctx context.Context, origin string) (num int64, ok bool, err error) {
	err = s.db.QueryRow(ctx, originGetSQL, origin).Scan(&num)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	return num, err == nil, err
}

// DeadLetterVouchParams is a dead letter a subscriber writes.
type DeadLetterVouchParams struct {
	Subscriber string
	StreamSeq  int64 // the event's sequence in the events stream
	EventID    int64
	Digest     []byte // what the runtime's LetterDigest makes of the event
}

// DeadLetterVouch records, as the subscriber's own role, that it
// dead-letters the event (row-level security lets a role write rows under
// its own name only).
func (s Store) DeadLetterVouch(ctx context.Context, p DeadLetterVouchParams) error {
	return s.exec(ctx, deadLetterVouchSQL, p.Subscriber, p.StreamSeq, p.EventID, p.Digest)
}
