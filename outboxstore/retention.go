package outboxstore

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// deleteSentSQL deletes one small batch of sent rows past their retention
// from outbox_default, the rows no range holds (see the schema): the
// ranges themselves are dropped whole (RetirePartition). Small batches
// keep each transaction short and the table from bloating. Old sent rows
// hold the lowest ids, so the walk up the primary key finds them first
// (there is no index on status = 'sent').
const deleteSentSQL = `
DELETE FROM outbox_default
WHERE id IN (
    SELECT id
    FROM outbox_default
    WHERE status = 'sent' AND published_at < now() - make_interval(secs => $1::float8)
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)`

// DeleteSent deletes up to batch sent rows of outbox_default published
// longer than retention ago.
func (s *Store) DeleteSent(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	ct, err := s.pool.Exec(ctx, deleteSentSQL, retention.Seconds(), batch)
	return ct.RowsAffected(), err
}

// deleteCapturedSQL deletes one small batch of rows of outbox_default that
// a wal relay captured (they stay pending in the table) past their
// retention; $3 is the slot's backlog bound: rows at or below it may still
// be waiting for the claim. A row an operator returned to the relays
// (available_at is then) counts from that moment: it may be old, and not
// yet published again.
const deleteCapturedSQL = `
DELETE FROM outbox_default
WHERE id IN (
    SELECT id
    FROM outbox_default
    WHERE published_at IS NULL AND status = 'pending' AND id > $3
      AND greatest(created_at, available_at) < now() - make_interval(secs => $1::float8)
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)`

// DeleteCaptured deletes up to batch captured rows of outbox_default (ids
// above backlogThrough) created longer than retention ago.
func (s *Store) DeleteCaptured(ctx context.Context, retention time.Duration, batch int, backlogThrough int64) (int64, error) {
	ct, err := s.pool.Exec(ctx, deleteCapturedSQL, retention.Seconds(), batch, backlogThrough)
	return ct.RowsAffected(), err
}

// Partition is one range of outbox ids (schema migration 00008): the
// relays add them ahead of the identity and drop them past retention.
type Partition struct {
	Name string
	// Lower is the range's first id; nil for the range holding every id
	// below the first (outbox_legacy).
	Lower *int64
	// Upper is the first id past the range.
	Upper int64
	// SealedAt is when every id of the range was handed out and committed
	// (nil before).
	SealedAt *time.Time
}

// Partitions lists the ranges, lowest first.
func (s *Store) Partitions(ctx context.Context) ([]Partition, error) {
	rows, err := s.pool.Query(ctx, `SELECT name, lower_id, upper_id, sealed_at FROM outbox_partitions ORDER BY upper_id`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Partition, error) {
		var p Partition
		err := row.Scan(&p.Name, &p.Lower, &p.Upper, &p.SealedAt)
		return p, err
	})
}

// ExtendPartitions adds ranges of span ids until ahead of them lie beyond
// the next id, and returns the names of those it added. When the ids have
// come within margin of the last range's end, the next range starts margin
// above the next id (see fanout_outbox_extend in the schema).
func (s *Store) ExtendPartitions(ctx context.Context, span int64, ahead int, margin int64) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT fanout_outbox_extend($1, $2, $3)`, span, ahead, margin)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// SealPartition seals a range whose ids were all handed out, once no
// transaction inserts into it any more; it says whether it did.
func (s *Store) SealPartition(ctx context.Context, name string) (bool, error) {
	var sealed bool
	err := s.pool.QueryRow(ctx, `SELECT fanout_outbox_seal($1)`, name).Scan(&sealed)
	return sealed, err
}

// AnalyzeRanges analyzes the ranges that hold ids above fromID, skipping
// any whose lock another session holds (migration 00018), and returns
// how many it analyzed: the claim's plans are made again with statistics
// that know a burst of rows.
func (s *Store) AnalyzeRanges(ctx context.Context, fromID int64) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, `SELECT fanout_outbox_analyze($1)`, fromID).Scan(&n)
	return n, err
}

// Retirement is what decides whether a sealed range may be dropped.
type Retirement struct {
	// Retention is how long after its last row was published a range is
	// kept (relay.sent_retention).
	Retention time.Duration
	// Captured says the relays capture from the WAL: their rows stay
	// pending, and a range is published once the slot confirmed past it.
	Captured bool
	// ConfirmedLSN is the slot's confirmed position (wal capture; "" when
	// unknown, and then no range is dropped).
	ConfirmedLSN string
	// BacklogThrough is the slot's backlog bound while its backlog is
	// being claimed (math.MinInt64 once done): a pending row at or below
	// it is still to be published.
	BacklogThrough int64
	// RequireAudit keeps a range until an audit of it passed since its
	// rows were last published (relay.audit).
	RequireAudit bool
}

// RetirePartition drops a sealed range whose rows were all published
// longer than the retention ago, moving its failed rows to outbox_default.
// When it does not, reason says why (the range is not yet due, or rows in
// it are still to be published).
func (s *Store) RetirePartition(ctx context.Context, name string, r Retirement) (retired bool, moved int64, reason string, err error) {
	var confirmed *string
	if r.ConfirmedLSN != "" {
		confirmed = &r.ConfirmedLSN
	}
	var why *string
	err = s.pool.QueryRow(ctx, `SELECT retired, moved, reason FROM fanout_outbox_retire($1, make_interval(secs => $2::float8), $3, $4::pg_lsn, $5, $6)`,
		name, r.Retention.Seconds(), r.Captured, confirmed, r.BacklogThrough, r.RequireAudit).Scan(&retired, &moved, &why)
	if why != nil {
		reason = *why
	}
	return retired, moved, reason, err
}
