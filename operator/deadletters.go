// Package operator is what the operator commands do (fanout status, fanout
// dlq): read the state of the outbox, the stream, the consumers, the
// checkpoints and the dead letters, and resolve dead letters with an audit
// trail. cmd/fanout parses their flags and prints their results.
package operator

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// DeadLetters reads the dead-letter stream and records what operators do
// with its letters in dead_letter_actions (the stream denies deletes, so
// that table is what tells a resolved letter from one to resolve).
type DeadLetters struct {
	pool   *pgxpool.Pool
	js     jetstream.JetStream
	stream jetstream.Stream
	events stream.Config
	subs   subscribers.Config
}

// OpenDeadLetters binds the dead-letter stream subs.DeadLetterStream.
func OpenDeadLetters(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, events stream.Config, subs subscribers.Config) (*DeadLetters, error) {
	s, err := js.Stream(ctx, subs.DeadLetterStream)
	if err != nil {
		return nil, fmt.Errorf("dead-letter stream %s: %w", subs.DeadLetterStream, err)
	}
	return &DeadLetters{pool: pool, js: js, stream: s, events: events, subs: subs}, nil
}

// Letter is one message of the dead-letter stream.
type Letter struct {
	Seq        uint64
	Subscriber string // from the subject it is stored under
	EventID    string
	EventType  string
	Reason     string
	Deliveries string
	At         string
	// Refused says why no command acts on this letter (it disagrees with
	// itself: see subscribers.ParseDeadLetter), or is empty.
	Refused string
	// Resolved says how an operator resolved it (redriven, discarded), or
	// is empty: the stream keeps resolved letters until they age out.
	Resolved string
	// HeldBy is, for an ordered subscriber's event held behind an earlier
	// dead-lettered event of its aggregate, that event's id.
	HeldBy string
	// Raw is the stored message.
	Raw    *jetstream.RawStreamMsg
	parsed subscribers.DeadLetter
}

// resolvedSQL finds the letters an operator resolved: discarded, or
// redriven with the event handled (or found already handled).
const resolvedSQL = `
SELECT DISTINCT ON (stream_seq, subscriber) stream_seq, subscriber, action || ' by ' || actor || ' at ' || to_char(at, 'YYYY-MM-DD"T"HH24:MI:SSOF')
FROM dead_letter_actions
WHERE action = 'discard' OR (action = 'redrive' AND outcome IN ('handled', 'already in the checkpoint'))
ORDER BY stream_seq, subscriber, at DESC`

// Outcomes of a redrive, as recorded (resolvedSQL names them too).
const (
	OutcomeHandled        = "handled"
	OutcomeAlreadyHandled = "already in the checkpoint"
)

type resolvedKey struct {
	seq        uint64
	subscriber string
}

// resolutions returns how each resolved letter was resolved.
func resolutions(ctx context.Context, pool *pgxpool.Pool) (map[resolvedKey]string, error) {
	rows, err := pool.Query(ctx, resolvedSQL)
	if err != nil {
		return nil, fmt.Errorf("read dead_letter_actions: %w", err)
	}
	out := map[resolvedKey]string{}
	var seq int64
	var subscriber, how string
	_, err = pgx.ForEachRow(rows, []any{&seq, &subscriber, &how}, func() error {
		out[resolvedKey{uint64(seq), subscriber}] = how
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read dead_letter_actions: %w", err)
	}
	return out, nil
}

// List returns the dead letters (of subscriber only, if not empty) in
// stream order, with how each was resolved if it was.
func (d *DeadLetters) List(ctx context.Context, subscriber string) ([]Letter, error) {
	resolved, err := resolutions(ctx, d.pool)
	if err != nil {
		return nil, err
	}
	filter := d.subs.DeadLetterSubjectPrefix + ".>"
	if subscriber != "" {
		filter = d.subs.DeadLetterSubjectPrefix + "." + subscriber + ".>"
	}
	info, err := d.stream.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []Letter
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; {
		m, err := d.stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(filter))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			return nil, err
		}
		l := d.describe(m)
		l.Resolved = resolved[resolvedKey{l.Seq, l.Subscriber}]
		out = append(out, l)
		seq = m.Sequence + 1
	}
	return out, nil
}

// Get returns the dead letter at seq.
func (d *DeadLetters) Get(ctx context.Context, seq uint64) (Letter, error) {
	m, err := d.stream.GetMsg(ctx, seq)
	if err != nil {
		return Letter{}, fmt.Errorf("dead letter %d: %w", seq, err)
	}
	resolved, err := resolutions(ctx, d.pool)
	if err != nil {
		return Letter{}, err
	}
	l := d.describe(m)
	l.Resolved = resolved[resolvedKey{l.Seq, l.Subscriber}]
	return l, nil
}

// Unresolved keeps the letters no operator has resolved yet.
func Unresolved(ls []Letter) []Letter {
	var out []Letter
	for _, l := range ls {
		if l.Resolved == "" {
			out = append(out, l)
		}
	}
	return out
}

func (d *DeadLetters) describe(m *jetstream.RawStreamMsg) Letter {
	p, err := subscribers.ParseDeadLetter(m, d.subs, d.events)
	l := Letter{Seq: m.Sequence, Subscriber: p.Subscriber, EventID: m.Header.Get(outbox.EventIDHeader),
		EventType: m.Header.Get(outbox.EventTypeHeader), Reason: p.Reason, Deliveries: p.Deliveries, At: p.At, parsed: p, Raw: m,
		HeldBy: m.Header.Get(subscribers.DeadHeldByHeader)}
	if err != nil {
		l.Refused = err.Error()
	}
	return l
}

// EventOf returns the event a redrive hands to the letter's subscriber: the
// copy in the events stream, after checking that the letter agrees with it
// and with itself (a letter is written by its subscriber's own process, and
// a redrive writes that subscriber's checkpoint: a forged letter must not
// make it skip a real event). fromLetter trusts the letter's own copy of an
// event the stream no longer holds.
func (d *DeadLetters) EventOf(ctx context.Context, l Letter, fromLetter bool) (subscribers.Event, error) {
	if l.Refused != "" {
		return subscribers.Event{}, errors.New(l.Refused)
	}
	p := l.parsed
	err := p.Verify(ctx, d.js, d.events)
	switch {
	case err == nil:
		return p.Event, nil
	case errors.Is(err, jetstream.ErrMsgNotFound) && fromLetter:
		if omitted := l.Raw.Header.Get(subscribers.DeadBodyOmittedHeader); omitted != "" {
			return subscribers.Event{}, fmt.Errorf("the dead letter was stored without the event's body (%s bytes) and the stream no longer holds the event", omitted)
		}
		return p.Event, nil
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return subscribers.Event{}, fmt.Errorf("%w; the events stream no longer holds the event: redrive with --from-letter to trust the dead letter's own copy", err)
	}
	return subscribers.Event{}, err
}

// Record notes an operator's action on a letter in dead_letter_actions
// (append-only: the operator role may not change or delete its rows).
func (d *DeadLetters) Record(ctx context.Context, action string, l Letter, outcome, actor string) error {
	id, _ := strconv.ParseInt(l.EventID, 10, 64)
	_, err := d.pool.Exec(ctx, `
INSERT INTO dead_letter_actions (action, subscriber, event_id, stream_seq, outcome, actor)
VALUES ($1, $2, nullif($3, 0), $4, $5, $6)`, action, l.Subscriber, id, int64(l.Seq), outcome, actor)
	return err
}

// Discard resolves the unresolved letters among ls without handling them,
// and returns how many it resolved. A letter that disagrees with itself is
// refused. The event of an ordered subscriber (ordered says which are)
// that holds its aggregate releases it: the aggregate moves past the
// event, and the letters held behind it can be redriven, in order.
func (d *DeadLetters) Discard(ctx context.Context, ls []Letter, ordered func(subscriber string) bool, actor string) (int, error) {
	n := 0
	for _, l := range ls {
		if l.Refused != "" {
			return n, fmt.Errorf("discard %d: %s", l.Seq, l.Refused)
		}
		if l.Resolved != "" {
			continue
		}
		if ordered != nil && ordered(l.Subscriber) && l.HeldBy == "" {
			id, _ := strconv.ParseInt(l.EventID, 10, 64)
			if _, err := subscribers.Release(ctx, d.pool, l.Subscriber, id); err != nil {
				return n, fmt.Errorf("discard %d: %w", l.Seq, err)
			}
		}
		if err := d.Record(ctx, "discard", l, "discarded", actor); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// Redriven is what became of one letter's redrive.
type Redriven struct {
	Letter  Letter
	Outcome string // OutcomeHandled, OutcomeAlreadyHandled, or "failed: ..."
	// Skipped: the letter was resolved already; nothing was done.
	Skipped bool
	Err     error
}

// Redrive hands each unresolved letter's event to its own subscriber's
// runner (runnerOf builds it, once per subscriber) and records each attempt.
// It stops at an error it cannot record; a handler's failure is recorded
// and reported in the letter's Redriven.
func (d *DeadLetters) Redrive(ctx context.Context, ls []Letter, runnerOf func(subscriber string) (*subscribers.Runner, error), fromLetter bool, actor string) ([]Redriven, error) {
	var out []Redriven
	for _, l := range ls {
		if l.Resolved != "" {
			out = append(out, Redriven{Letter: l, Outcome: "already resolved: " + l.Resolved, Skipped: true})
			continue
		}
		outcome := OutcomeHandled
		ev, err := d.EventOf(ctx, l, fromLetter)
		if err == nil {
			var r *subscribers.Runner
			if r, err = runnerOf(l.Subscriber); err != nil {
				return out, err
			}
			var handled bool
			if handled, err = r.HandleOnce(ctx, ev); err == nil && !handled {
				outcome = OutcomeAlreadyHandled
			}
		}
		if err != nil {
			outcome = "failed: " + err.Error()
		}
		if rerr := d.Record(ctx, "redrive", l, outcome, actor); rerr != nil {
			return out, fmt.Errorf("record redrive of %d: %w", l.Seq, rerr)
		}
		out = append(out, Redriven{Letter: l, Outcome: outcome, Err: err})
	}
	return out, nil
}

// Counts counts the letters to resolve per subscriber: the stream's
// per-subject state (<prefix>.<subscriber>.<event_type>) less the letters
// still in it that operators resolved. A stream not created yet has none.
func Counts(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, subs subscribers.Config) (map[string]uint64, error) {
	out := map[string]uint64{}
	s, err := js.Stream(ctx, subs.DeadLetterStream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subs.DeadLetterSubjectPrefix+".>"))
	if err != nil {
		return nil, err
	}
	for subject, n := range info.State.Subjects {
		if name, ok := subscriberOf(subject); ok {
			out[name] += n
		}
	}
	resolved, err := resolutions(ctx, pool)
	if err != nil {
		return nil, err
	}
	for k := range resolved {
		if k.seq >= info.State.FirstSeq && out[k.subscriber] > 0 {
			out[k.subscriber]--
		}
	}
	return out, nil
}
