package outboxstore

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Writers are the declarations of which role may write which event types
// (outbox_writer_types, migration 00026): Postgres refuses an outbox row
// whose session role no declaration covers. A declaration names a role
// (an application's login role, or a group role such as fanout_writer,
// for its members) and one event type, or AnyEventType.
type Writers struct {
	pool *pgxpool.Pool
}

// AnyEventType in a declaration lets its role write every event type.
const AnyEventType = "*"

// NewWriters returns the declarations of the database behind pool.
func NewWriters(pool *pgxpool.Pool) *Writers { return &Writers{pool: pool} }

// WriterType is one declaration.
type WriterType struct {
	Writer, EventType string
	DeclaredAt        time.Time
	DeclaredBy        string
	Reason            string
}

// List returns every declaration, by role and type.
func (w *Writers) List(ctx context.Context) ([]WriterType, error) {
	rows, err := w.pool.Query(ctx, `SELECT writer, event_type, declared_at, declared_by, reason
FROM outbox_writer_types ORDER BY writer, event_type`)
	if err != nil {
		return nil, fmt.Errorf("read the writers' event types: %w", err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (WriterType, error) {
		var d WriterType
		return d, r.Scan(&d.Writer, &d.EventType, &d.DeclaredAt, &d.DeclaredBy, &d.Reason)
	})
	if err != nil {
		return nil, fmt.Errorf("read the writers' event types: %w", err)
	}
	return got, nil
}

// Allow lets writer write eventType (fanout_outbox_allow_writer, which
// records the session's role with reason); it reports whether the
// declaration is new.
func (w *Writers) Allow(ctx context.Context, writer, eventType, reason string) (bool, error) {
	var added bool
	if err := w.pool.QueryRow(ctx, `SELECT fanout_outbox_allow_writer($1, $2, $3)`, writer, eventType, reason).Scan(&added); err != nil {
		return false, fmt.Errorf("let %s write %s: %w", writer, eventType, err)
	}
	return added, nil
}

// Withdraw takes a declaration back (fanout_outbox_withdraw_writer); it
// reports whether there was one.
func (w *Writers) Withdraw(ctx context.Context, writer, eventType string) (bool, error) {
	var gone bool
	if err := w.pool.QueryRow(ctx, `SELECT fanout_outbox_withdraw_writer($1, $2)`, writer, eventType).Scan(&gone); err != nil {
		return false, fmt.Errorf("withdraw %s's %s: %w", writer, eventType, err)
	}
	return gone, nil
}
