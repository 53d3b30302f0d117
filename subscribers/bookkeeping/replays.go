package bookkeeping

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// Replays are the operator's requests to move a subscriber's consumer to
// a stream position, and what came of each (replays, migration 00027). The
// operator records a request; an instance of the subscriber, which alone
// may reset its own consumer, takes it, moves the consumer and records the
// outcome in the same transaction. Every statement goes through a function
// that records the session's role and checks that the role taking or
// finishing a request acts for its subscriber.
type Replays struct{ db DB }

// NewReplays returns the replays of db (a pool, or the transaction a
// request is taken in).
func NewReplays(db DB) Replays { return Replays{db: db} }

// ReplayRequest is what the operator asks: Subscriber's consumer on Stream
// moved to FromSeq by an instance that takes it Within; Reason is
// recorded.
type ReplayRequest struct {
	Subscriber, Stream string
	FromSeq            uint64
	Within             time.Duration
	Reason             string
}

// Request records r (fanout_replay_request) and returns its id.
func (rs Replays) Request(ctx context.Context, r ReplayRequest) (int64, error) {
	var id int64
	err := rs.db.QueryRow(ctx, `SELECT fanout_replay_request($1, $2, $3, $4, $5)`,
		r.Subscriber, r.Stream, int64(r.FromSeq), r.Within, r.Reason).Scan(&id)
	return id, err
}

// Outcomes of a request besides the subscriber's own text.
const (
	ReplayRequested = "requested" // not taken yet, and not lapsed
	ReplayLapsed    = "lapsed"    // not taken in time: nothing moved, nothing will
	ReplayMoved     = "moved"     // the consumer is at the request's position
)

// ReplayOutcome is what became of a request, and the role that recorded
// it (empty while requested or once lapsed).
type ReplayOutcome struct{ Outcome, Actor string }

// Outcome reads what became of request id (fanout_replay_outcome). It
// waits for an instance holding the request to finish, so a lapse it
// reports is final.
func (rs Replays) Outcome(ctx context.Context, id int64) (ReplayOutcome, error) {
	var o ReplayOutcome
	var actor *string
	err := rs.db.QueryRow(ctx, `SELECT outcome, actor FROM fanout_replay_outcome($1)`, id).Scan(&o.Outcome, &actor)
	if actor != nil {
		o.Actor = *actor
	}
	return o, err
}

// TakenReplay is a request an instance holds until its transaction ends.
type TakenReplay struct {
	ID                  int64
	Stream              string
	FromSeq             uint64
	RequestedBy, Reason string
}

const replayTakeSQL = `SELECT id, stream, from_seq, actor, comment FROM fanout_replay_take($1)`

// Take holds subscriber's oldest request that is neither done nor lapsed
// (fanout_replay_take), if there is one: run it in a transaction, move the
// consumer, then Finish in the same transaction.
func (rs Replays) Take(ctx context.Context, subscriber string) (TakenReplay, bool, error) {
	var t TakenReplay
	var seq int64
	err := rs.db.QueryRow(ctx, replayTakeSQL, subscriber).Scan(&t.ID, &t.Stream, &seq, &t.RequestedBy, &t.Reason)
	if errors.Is(err, pgx.ErrNoRows) {
		return TakenReplay{}, false, nil
	}
	t.FromSeq = uint64(max(seq, 0))
	return t, err == nil, err
}

// Finish records what came of request id: ReplayMoved, or why not
// (fanout_replay_finish).
func (rs Replays) Finish(ctx context.Context, id int64, outcome string) error {
	_, err := rs.db.Exec(ctx, `SELECT fanout_replay_finish($1, $2)`, id, outcome)
	return err
}

// ReplayRecord is a request and what came of it.
type ReplayRecord struct {
	ID          int64     `json:"id"`
	Subscriber  string    `json:"subscriber"`
	Stream      string    `json:"stream"`
	FromSeq     uint64    `json:"from_seq"`
	RequestedBy string    `json:"requested_by"`
	Reason      string    `json:"reason,omitempty"`
	RequestedAt time.Time `json:"requested_at"`
	// Outcome is ReplayMoved or why not, ReplayRequested while it may
	// still be taken, or ReplayLapsed; By is the role that recorded it.
	Outcome string `json:"outcome"`
	By      string `json:"by,omitempty"`
}

// Recent returns the requests made since since, newest first, at most
// limit.
func (rs Replays) Recent(ctx context.Context, since time.Time, limit int) ([]ReplayRecord, error) {
	rows, err := rs.db.Query(ctx, `
SELECT r.id, r.subscriber, r.stream, r.from_seq, r.actor, r.comment, r.at,
       coalesce(o.outcome, CASE WHEN r.lapses_at > now() THEN 'requested' ELSE 'lapsed' END), coalesce(o.actor, '')
FROM replays r LEFT JOIN replays o ON o.request_id = r.id
WHERE r.request_id IS NULL AND r.lapses_at IS NOT NULL AND r.at >= $1
ORDER BY r.id DESC LIMIT $2`, since, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (ReplayRecord, error) {
		var r ReplayRecord
		var seq int64
		err := row.Scan(&r.ID, &r.Subscriber, &r.Stream, &seq, &r.RequestedBy, &r.Reason, &r.RequestedAt, &r.Outcome, &r.By)
		r.FromSeq = uint64(max(seq, 0))
		return r, err
	})
}
