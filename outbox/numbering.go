package outbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
)

// ErrNoNumbering: the outbox has no numbering trigger.
var ErrNoNumbering = errors.New("the outbox has no numbering trigger (outbox_sequence, migration 00009): run fanout migrate")

// Unnumbered returns the event types the outbox does not number (no
// aggregate_seq, so no per-aggregate order), sorted; none by default, on
// q (a pool, a connection or a transaction). See outboxstore's
// SetNumbering.
//
// The list is read from the numbering trigger's arguments in pg_trigger,
// which every role may read: an ordered subscriber checks it with no grant.
func Unnumbered(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) ([]string, error) {
	var n int16
	var args []byte
	err := q.QueryRow(ctx, `
SELECT tgnargs, tgargs FROM pg_trigger
WHERE tgrelid = 'outbox'::regclass AND tgname = 'outbox_sequence'`).Scan(&n, &args)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNoNumbering
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
