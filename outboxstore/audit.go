package outboxstore

// Where each published event landed in the stream, and the audits that
// check the stream against it (schema migration 00017; the auditor is
// package relay's audit.go).

import (
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// Landed is one published event's place in the stream.
type Landed struct {
	ID  int64
	Seq uint64
}

// ContentDigest is the SHA-256 of what a row says its message holds: its
// subject, a newline, and its payload as Postgres writes it out (jsonb's
// text, which both captures publish). ContentOf makes it of a message.
type ContentDigest [32]byte

// ContentOf is the digest of a message with subject and data.
func ContentOf(subject string, data []byte) ContentDigest {
	h := sha256.New()
	h.Write([]byte(subject))
	h.Write([]byte{'\n'})
	h.Write(data)
	var d ContentDigest
	h.Sum(d[:0])
	return d
}

// insertLandingsSQL records one published batch's landings.
const insertLandingsSQL = `
INSERT INTO outbox_landings (stream, first_id, last_id, event_ids, seqs) VALUES ($1, $2, $3, $4, $5)`

// landingArgs are insertLandingsSQL's arguments for ls.
func landingArgs(stream string, ls []Landed) []any {
	ids, seqs := make([]int64, len(ls)), make([]int64, len(ls))
	first, last := ls[0].ID, ls[0].ID
	for i, l := range ls {
		ids[i], seqs[i] = l.ID, int64(l.Seq)
		first, last = min(first, l.ID), max(last, l.ID)
	}
	return []any{stream, first, last, ids, seqs}
}

// RecordLandings records where the events ls landed in stream (a wal
// relay's batches, and the auditor's repairs; a poll relay records them
// with the batch's outcomes, Outcomes.Landed).
func (s *Store) RecordLandings(ctx context.Context, stream string, ls []Landed) error {
	if len(ls) == 0 {
		return nil
	}
	if _, err := s.pool.Exec(ctx, insertLandingsSQL, landingArgs(stream, ls)...); err != nil {
		return fmt.Errorf("record where %d events landed: %w", len(ls), err)
	}
	return nil
}

// Landing is one recorded batch of landings.
type Landing struct {
	ID       int64
	LandedAt time.Time
	Events   []Landed
}

func scanLanding(row pgx.CollectableRow) (Landing, error) {
	var l Landing
	var ids, seqs []int64
	if err := row.Scan(&l.ID, &l.LandedAt, &ids, &seqs); err != nil {
		return l, err
	}
	l.Events = make([]Landed, len(ids))
	for i := range ids {
		l.Events[i] = Landed{ID: ids[i], Seq: uint64(seqs[i])}
	}
	return l, nil
}

// Landings lists, in order, up to limit landings in stream after the
// landing after, landed at or after since and before before.
func (s *Store) Landings(ctx context.Context, stream string, after int64, since, before time.Time, limit int) ([]Landing, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, landed_at, event_ids, seqs FROM outbox_landings
WHERE stream = $1 AND id > $2 AND landed_at >= $3 AND landed_at < $4
ORDER BY id LIMIT $5`, stream, after, since, before, limit)
	if err != nil {
		return nil, fmt.Errorf("read the outbox's landings: %w", err)
	}
	ls, err := pgx.CollectRows(rows, scanLanding)
	if err != nil {
		return nil, fmt.Errorf("read the outbox's landings: %w", err)
	}
	return ls, nil
}

// TailLandings lists, in order, up to limit landings in stream after the
// landing after, up to (not including) the first one younger than delay
// by the database's clock: the continuous audit never moves past a
// landing it has not checked.
func (s *Store) TailLandings(ctx context.Context, stream string, after int64, delay time.Duration, limit int) ([]Landing, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, landed_at, event_ids, seqs FROM outbox_landings
WHERE stream = $1 AND id > $2
  AND id < coalesce((SELECT min(id) FROM outbox_landings WHERE stream = $1 AND id > $2
                     AND landed_at >= now() - make_interval(secs => $3::float8)), 9223372036854775807)
ORDER BY id LIMIT $4`, stream, after, delay.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("read the outbox's landings: %w", err)
	}
	ls, err := pgx.CollectRows(rows, scanLanding)
	if err != nil {
		return nil, fmt.Errorf("read the outbox's landings: %w", err)
	}
	return ls, nil
}

// AuditState is the continuous audit's progress.
type AuditState struct {
	// TailLanding: every landing up to it was checked once old enough.
	TailLanding int64
	// FromID is the first outbox id whose publish is recorded: rows below
	// it were published before landings were, and are not audited.
	FromID int64
}

// AuditState reads the auditor's progress.
func (s *Store) AuditState(ctx context.Context) (AuditState, error) {
	var st AuditState
	if err := s.pool.QueryRow(ctx, `SELECT tail_landing, from_id FROM outbox_audit_state`).Scan(&st.TailLanding, &st.FromID); err != nil {
		return st, fmt.Errorf("read the audit's state: %w", err)
	}
	return st, nil
}

// AdvanceTail records that the landings up to landing were checked.
func (s *Store) AdvanceTail(ctx context.Context, landing int64) error {
	if _, err := s.pool.Exec(ctx, `UPDATE outbox_audit_state SET tail_landing = greatest(tail_landing, $1)`, landing); err != nil {
		return fmt.Errorf("record the audit's progress: %w", err)
	}
	return nil
}

// DueAudit is a range whose drop waits for an audit: sealed, its rows
// published longer than the retention ago, last published at Due, and not
// audited since (fanout_outbox_retire noted it in audit_due when it kept
// the range for it).
type DueAudit struct {
	Partition
	Due time.Time
}

// PartitionsToAudit lists the ranges whose drop waits for an audit.
func (s *Store) PartitionsToAudit(ctx context.Context) ([]DueAudit, error) {
	rows, err := s.pool.Query(ctx, `
SELECT name, lower_id, upper_id, sealed_at, audit_due FROM outbox_partitions
WHERE audit_due IS NOT NULL AND (audited_at IS NULL OR audited_at <= audit_due)
ORDER BY upper_id`)
	if err != nil {
		return nil, fmt.Errorf("list the ranges to audit: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (DueAudit, error) {
		var d DueAudit
		err := row.Scan(&d.Name, &d.Lower, &d.Upper, &d.SealedAt, &d.Due)
		return d, err
	})
}

// rangeEventsSQL lists a window of a range's published rows ($2 <= id <
// $3, at or above the first recorded id $4) with the newest landing of
// each (sequence 0: none) and when it landed. Published: sent (a poll
// relay's, and a wal relay's backlog); in wal capture ($5) also pending
// rows the slot captured, that is none returned to the relays after the
// range's last publish ($6: an operator's retry, which the relays will
// publish). Failed and skipped rows were never published. unsettled
// counts the rows still on their way (claimed, or returned since): a
// range with any is not marked audited.
const rangeEventsSQL = `
WITH landed AS (
    SELECT DISTINCT ON (e.id) e.id, e.seq, l.landed_at
    FROM outbox_landings l, unnest(l.event_ids, l.seqs) AS e(id, seq)
    WHERE l.stream = $1 AND l.last_id >= $2 AND l.first_id < $3 AND e.id >= $2 AND e.id < $3
    ORDER BY e.id, l.id DESC
)
SELECT o.id, coalesce(landed.seq, 0), landed.landed_at,
       o.status = 'sending' OR (o.status = 'pending' AND (NOT $5 OR o.available_at > $6)) AS unsettled,
       sha256(convert_to($7 || '.' || o.event_type || E'\n' || o.payload::text, 'UTF8'))
FROM outbox o LEFT JOIN landed ON landed.id = o.id
WHERE o.id >= greatest($2, $4) AND o.id < $3 AND o.status IN ('sent', 'pending', 'sending')`

// RangeWindow is one window of a range's published rows.
type RangeWindow struct {
	Events []Landed
	// Contents are the digests of the events' rows' contents, by id.
	Contents map[int64]ContentDigest
	// Youngest is when the newest of the window's landings landed (a
	// repair's copy may not be on disk yet).
	Youngest time.Time
	// Unsettled rows are on their way to the stream (see rangeEventsSQL).
	Unsettled int
}

// RangeEvents lists the published rows of ids [lower, upper) at or above
// fromID with the stream sequence each landed at (0: no landing
// recorded) and the digest of what each row says its message holds under
// subjectPrefix. captured says the relays capture from the WAL, whose
// published rows stay pending; a pending row returned after due is not
// taken for published.
func (s *Store) RangeEvents(ctx context.Context, stream, subjectPrefix string, lower, upper, fromID int64, captured bool, due time.Time) (RangeWindow, error) {
	rows, err := s.pool.Query(ctx, rangeEventsSQL, stream, lower, upper, fromID, captured, due, subjectPrefix)
	if err != nil {
		return RangeWindow{}, fmt.Errorf("list a range's events and landings: %w", err)
	}
	w := RangeWindow{Contents: map[int64]ContentDigest{}}
	var id, seq int64
	var at *time.Time
	var unsettled bool
	var digest []byte
	_, err = pgx.ForEachRow(rows, []any{&id, &seq, &at, &unsettled, &digest}, func() error {
		if unsettled {
			w.Unsettled++
			return nil
		}
		w.Events = append(w.Events, Landed{ID: id, Seq: uint64(seq)})
		var d ContentDigest
		copy(d[:], digest)
		w.Contents[id] = d
		if at != nil && at.After(w.Youngest) {
			w.Youngest = *at
		}
		return nil
	})
	if err != nil {
		return RangeWindow{}, fmt.Errorf("list a range's events and landings: %w", err)
	}
	return w, nil
}

// MarkAudited records that the range passed an audit that began at began.
func (s *Store) MarkAudited(ctx context.Context, name string, began time.Time) error {
	if _, err := s.pool.Exec(ctx, `UPDATE outbox_partitions SET audited_at = $2 WHERE name = $1`, name, began); err != nil {
		return fmt.Errorf("record range %s audited: %w", name, err)
	}
	return nil
}

// Audit is one audit's record.
type Audit struct {
	Kind       string    `json:"kind"`
	Scope      string    `json:"scope"`
	StartedAt  time.Time `json:"started_at"`
	FinishedAt time.Time `json:"finished_at"`
	Checked    int64     `json:"checked"`
	Missing    int64     `json:"missing"`
	Repaired   int64     `json:"repaired"`
	Detail     string    `json:"detail,omitempty"`
}

// auditKeep is how long audit records are kept.
const auditKeep = 7 * 24 * time.Hour

// RecordAudit records an audit, and forgets those older than a week.
func (s *Store) RecordAudit(ctx context.Context, a Audit) error {
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO outbox_audits (kind, scope, started_at, checked, missing, repaired, detail) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		a.Kind, a.Scope, a.StartedAt, a.Checked, a.Missing, a.Repaired, a.Detail)
	b.Queue(`DELETE FROM outbox_audits WHERE finished_at < now() - make_interval(secs => $1::float8)`, auditKeep.Seconds())
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("record an audit: %w", err)
	}
	return nil
}

// Audits returns the newest audits, newest first: the last one, and the
// last one that found something missing, if another.
func (s *Store) Audits(ctx context.Context) ([]Audit, error) {
	rows, err := s.pool.Query(ctx, `
(SELECT kind, scope, started_at, finished_at, checked, missing, repaired, detail FROM outbox_audits ORDER BY id DESC LIMIT 1)
UNION
(SELECT kind, scope, started_at, finished_at, checked, missing, repaired, detail FROM outbox_audits WHERE missing > 0 ORDER BY id DESC LIMIT 1)`)
	if err != nil {
		return nil, fmt.Errorf("read the audits: %w", err)
	}
	as, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Audit])
	if err != nil {
		return nil, fmt.Errorf("read the audits: %w", err)
	}
	slices.SortFunc(as, func(a, b Audit) int { return b.FinishedAt.Compare(a.FinishedAt) })
	return as, nil
}

// Rows reads the outbox rows with the given ids, as the relay publishes
// them (the auditor's repairs); rows no longer there are left out.
func (s *Store) Rows(ctx context.Context, ids []int64) ([]Claimed, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, aggregate_seq
FROM outbox WHERE id = ANY($1) ORDER BY id`, ids)
	if err != nil {
		return nil, fmt.Errorf("read %d outbox rows: %w", len(ids), err)
	}
	out, err := pgx.CollectRows(rows, scanClaimed)
	if err != nil {
		return nil, fmt.Errorf("read %d outbox rows: %w", len(ids), err)
	}
	return out, nil
}

// NewestLandings returns where each of the events ids landed last in
// stream (none: not there).
func (s *Store) NewestLandings(ctx context.Context, stream string, ids []int64) (map[int64]uint64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	lo, hi := slices.Min(ids), slices.Max(ids)
	// A join, not e.id = ANY($4): that is checked against each id of the
	// array in turn, for every landed event of the span.
	rows, err := s.pool.Query(ctx, `
SELECT DISTINCT ON (e.id) e.id, e.seq
FROM outbox_landings l, unnest(l.event_ids, l.seqs) AS e(id, seq), (SELECT DISTINCT unnest($4::bigint[]) AS id) AS w
WHERE l.stream = $1 AND l.last_id >= $2 AND l.first_id <= $3 AND e.id = w.id
ORDER BY e.id, l.id DESC`, stream, lo, hi, ids)
	if err != nil {
		return nil, fmt.Errorf("read where events landed last: %w", err)
	}
	out := make(map[int64]uint64, len(ids))
	var id, seq int64
	_, err = pgx.ForEachRow(rows, []any{&id, &seq}, func() error {
		out[id] = uint64(seq)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read where events landed last: %w", err)
	}
	return out, nil
}

// LandedThrough is the highest event id with a landing recorded in
// stream (0: none).
func (s *Store) LandedThrough(ctx context.Context, stream string) (int64, error) {
	var id int64
	if err := s.pool.QueryRow(ctx, `SELECT coalesce(max(last_id), 0) FROM outbox_landings WHERE stream = $1`, stream).Scan(&id); err != nil {
		return 0, fmt.Errorf("read the newest landing: %w", err)
	}
	return id, nil
}

// Now is the database's clock.
func (s *Store) Now(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := s.pool.QueryRow(ctx, `SELECT now()`).Scan(&t); err != nil {
		return t, fmt.Errorf("read the database's clock: %w", err)
	}
	return t, nil
}
