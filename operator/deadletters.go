// Package operator is what the operator commands do (fanout status, fanout
// dlq): read the state of the outbox, the stream, the consumers, the
// checkpoints and the dead letters, and resolve dead letters with an audit
// trail. cmd/fanout parses their flags and prints their results.
package operator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// DeadLetters reads the dead-letter stream and records what operators do
// with its letters in dead_letter_actions (the stream denies deletes, so
// that table is what tells a resolved letter from one to resolve).
type DeadLetters struct {
	pool   *pgxpool.Pool
	store  *outboxstore.Store
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
	return &DeadLetters{pool: pool, store: outboxstore.New(pool), js: js, stream: s, events: events, subs: subs}, nil
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
	// Vouched: the subscriber recorded this dead letter in dead_letters
	// (its events stream sequence and event id), as its own Postgres role,
	// before publishing it. A letter no subscriber vouches for was written
	// by someone else (or before dead_letters existed): it is never
	// redriven, and discarding it takes a reason.
	Vouched bool
	// Intact: vouched, and the letter's copy of the event (subject, event
	// headers, body) is the one the subscriber recorded the digest of.
	// Only an intact letter's copy is ever handed to a handler.
	Intact bool
	// Raw is the stored message.
	Raw    *jetstream.RawStreamMsg
	parsed subscribers.DeadLetter
}

// resolvedSQL finds the letters an operator resolved: discarded, or
// redriven with the event handled (or found already handled).
const resolvedSQL = `
SELECT DISTINCT ON (stream_seq, subscriber) stream_seq, subscriber,
       action || ' by ' || actor || coalesce(' (' || nullif(comment, '') || ')', '') || ' at ' || to_char(at, 'YYYY-MM-DD"T"HH24:MI:SSOF')
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
	vouched, err := vouchedFor(ctx, d.pool)
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
		out = append(out, d.describe(m, vouched, resolved))
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
	vouched, err := vouchedFor(ctx, d.pool)
	if err != nil {
		return Letter{}, err
	}
	return d.describe(m, vouched, resolved), nil
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

// describe reads m into a Letter, with what dead_letters (vouched) and
// dead_letter_actions (resolved) say of it.
func (d *DeadLetters) describe(m *jetstream.RawStreamMsg, vouched map[vouchKey][]byte, resolved map[resolvedKey]string) Letter {
	p, err := subscribers.ParseDeadLetter(m, d.subs, d.events)
	l := Letter{Seq: m.Sequence, Subscriber: p.Subscriber, EventID: m.Header.Get(wire.EventIDHeader),
		EventType: m.Header.Get(wire.EventTypeHeader), Reason: p.Reason, Deliveries: p.Deliveries, At: p.At, parsed: p, Raw: m,
		HeldBy: m.Header.Get(subscribers.DeadHeldByHeader), Resolved: resolved[resolvedKey{m.Sequence, p.Subscriber}]}
	if err != nil {
		l.Refused = err.Error()
	}
	digest, ok := vouched[vouchKey{l.Subscriber, eventSeq(m), p.Event.ID}]
	l.Vouched = err == nil && ok
	l.Intact = l.Vouched && m.Header.Get(subscribers.DeadBodyOmittedHeader) == "" &&
		bytes.Equal(digest, subscribers.LetterDigest(m.Data, m.Header, m.Header.Get(subscribers.DeadSubjectHeader)))
	return l
}

// eventSeq is the events stream sequence a letter names.
func eventSeq(m *jetstream.RawStreamMsg) uint64 {
	seq, _ := strconv.ParseUint(m.Header.Get(subscribers.DeadStreamSeqHeader), 10, 64)
	return seq
}

// vouchKey is one row of dead_letters: a subscriber, the events stream
// sequence it dead-lettered, and the event id the message carried.
type vouchKey struct {
	subscriber string
	seq        uint64
	event      int64
}

// vouchedFor reads the dead letters the subscribers vouch for, with the
// digest of each one's event.
func vouchedFor(ctx context.Context, pool *pgxpool.Pool) (map[vouchKey][]byte, error) {
	rows, err := pool.Query(ctx, `SELECT subscriber, stream_seq, event_id, digest FROM dead_letters`)
	if err != nil {
		return nil, fmt.Errorf("read dead_letters: %w", err)
	}
	out := map[vouchKey][]byte{}
	var k vouchKey
	var seq int64
	var digest []byte
	_, err = pgx.ForEachRow(rows, []any{&k.subscriber, &seq, &k.event, &digest}, func() error {
		k.seq = uint64(seq)
		out[k] = slices.Clone(digest)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read dead_letters: %w", err)
	}
	return out, nil
}

// EventOf returns the event a redrive hands to the letter's subscriber, and
// where it was read. Only a letter its subscriber vouched for is redriven
// (the subscriber's runtime saw that event at that sequence, and recorded
// it as its own database role). Postgres is the truth: while the outbox
// holds the event's row, the event is read from it (as the relay published
// it), checked against the letter and against the events stream's copy at
// the sequence the letter names, if the stream still holds it; then the
// stream's copy; and the letter's own copy only with fromLetter, when the
// event is gone from both (its sequence below the stream's first) and the
// letter is intact (its copy is the one its subscriber recorded the digest
// of). A redrive writes the subscriber's checkpoint: a forged letter must
// not make it handle an event nobody wrote, nor skip a real one.
func (d *DeadLetters) EventOf(ctx context.Context, l Letter, fromLetter bool) (subscribers.Event, string, error) {
	if l.Refused != "" {
		return subscribers.Event{}, "", errors.New(l.Refused)
	}
	if !l.Vouched {
		return subscribers.Event{}, "", fmt.Errorf("%w: letter %d: subscriber %s never recorded it in dead_letters (it was written by someone else, or before schema migration 00014): it is not redriven; discard it with a reason, and replay the subscriber if the event is one it missed",
			subscribers.ErrDeadLetterRefused, l.Seq, l.Subscriber)
	}
	p := l.parsed
	ours, err := d.ours(ctx, p.Event)
	if err != nil {
		return subscribers.Event{}, "", err
	}
	if ours {
		row, found, err := d.store.Event(ctx, p.Event.ID)
		if err != nil {
			return subscribers.Event{}, "", err
		}
		if found {
			ev, err := d.fromRow(ctx, l, row)
			return ev, SourceOutbox, err
		}
	}
	err = p.Verify(ctx, d.js, d.events)
	if err == nil {
		return p.Event, SourceStream, nil
	}
	if !errors.Is(err, jetstream.ErrMsgNotFound) {
		return subscribers.Event{}, "", err
	}
	if err := d.agedOut(ctx, l); err != nil {
		return subscribers.Event{}, "", err
	}
	if !fromLetter {
		return subscribers.Event{}, "", fmt.Errorf("%w; neither the outbox nor the events stream holds the event any more: redrive with --from-letter to trust the dead letter's own copy", err)
	}
	if omitted := l.Raw.Header.Get(subscribers.DeadBodyOmittedHeader); omitted != "" {
		return subscribers.Event{}, "", fmt.Errorf("the dead letter was stored without the event's body (%s bytes) and neither the outbox nor the stream holds the event", omitted)
	}
	if !l.Intact {
		return subscribers.Event{}, "", fmt.Errorf("%w: letter %d: its copy of event %d is not the one subscriber %s recorded (the digest in dead_letters differs): not trusted",
			subscribers.ErrDeadLetterRefused, l.Seq, p.Event.ID, l.Subscriber)
	}
	return p.Event, SourceLetter, nil
}

// ours says whether this database's outbox row with the event's id is
// that event: the event is of this database and of the epoch that row id
// belongs to (an event without an origin was published before events
// carried one: this database's first epoch). Another database's event 42,
// or the event 42 a restore lost, is not read from this outbox's row 42.
func (d *DeadLetters) ours(ctx context.Context, ev subscribers.Event) (bool, error) {
	if ev.ID <= 0 {
		return false, nil
	}
	ident, err := d.store.ReadIdentity(ctx)
	if err != nil {
		return false, err
	}
	origin := ev.Origin
	if origin == "" {
		origin = outbox.Origin{Database: ident.Database, Epoch: 1}.String()
	}
	return origin == ident.OriginOf(ev.ID), nil
}

// agedOut checks that the stream no longer holding the letter's event is
// because of its age: the sequence is below the stream's first. A sequence
// the stream should hold, and does not, never held that event.
func (d *DeadLetters) agedOut(ctx context.Context, l Letter) error {
	seq := eventSeq(l.Raw)
	s, err := d.js.Stream(ctx, d.events.Name)
	if err != nil {
		return err
	}
	if first := s.CachedInfo().State.FirstSeq; seq >= first {
		return fmt.Errorf("%w: letter %d names %s sequence %d, which the stream (first sequence %d) should hold but does not: no such event was ever there",
			subscribers.ErrDeadLetterRefused, l.Seq, d.events.Name, seq, first)
	}
	return nil
}

// Where a redriven event was read from.
const (
	SourceOutbox = "the outbox row"
	SourceStream = "the events stream"
	SourceLetter = "the dead letter's own copy"
)

// fromRow reads the letter's event from its outbox row, checking that the
// letter names it rightly: the subject it was published on, and the
// stream's copy at the letter's sequence if the stream still holds it.
func (d *DeadLetters) fromRow(ctx context.Context, l Letter, row outboxstore.Claimed) (subscribers.Event, error) {
	ident, err := d.store.ReadIdentity(ctx)
	if err != nil {
		return subscribers.Event{}, err
	}
	msg, err := wire.Encode(d.events, ident, row, 0)
	if err != nil {
		return subscribers.Event{}, fmt.Errorf("%w: letter %d names event %d, whose outbox row was never publishable (%v)", subscribers.ErrDeadLetterRefused, l.Seq, row.ID, err)
	}
	if claimed := l.Raw.Header.Get(subscribers.DeadSubjectHeader); claimed != msg.Subject {
		return subscribers.Event{}, fmt.Errorf("%w: letter %d names event %d on %s, but its outbox row is %s",
			subscribers.ErrDeadLetterRefused, l.Seq, row.ID, claimed, msg.Subject)
	}
	p := l.parsed
	if err := p.Verify(ctx, d.js, d.events); errors.Is(err, jetstream.ErrMsgNotFound) {
		if err := d.agedOut(ctx, l); err != nil {
			return subscribers.Event{}, err
		}
	} else if err != nil {
		return subscribers.Event{}, err
	}
	if err := subscribers.Receives(ctx, d.js, d.events, l.Subscriber, msg.Subject); err != nil {
		return subscribers.Event{}, fmt.Errorf("%w: letter %d: %v", subscribers.ErrDeadLetterRefused, l.Seq, err)
	}
	ev, err := subscribers.EventFromParts(msg.Data, msg.Header, msg.Subject, d.events.SubjectPrefix)
	if err != nil {
		return subscribers.Event{}, err
	}
	ev.StreamSeq = eventSeq(l.Raw)
	return ev, nil
}

// Record notes an operator's action on a letter in dead_letter_actions,
// through fanout_dead_letter_action (schema migration 00014): the only way
// the operator role may add to it. It records the session's database role
// as the actor and comment beside it; a discard there also releases the
// aggregate an ordered subscriber holds behind the event.
func (d *DeadLetters) Record(ctx context.Context, action string, l Letter, outcome, comment string) error {
	id, _ := strconv.ParseInt(l.EventID, 10, 64)
	db, err := outbox.ReadDatabase(ctx, d.pool)
	if err != nil {
		return err
	}
	// The checkpoint and a held aggregate know the event by its key (its
	// origin and id); an origin no subscriber numbered has no checkpoint
	// and holds nothing (no key is negative).
	key, ok, err := subscribers.CheckpointKey(ctx, d.pool, db, l.parsed.Event.Origin, id)
	if err != nil {
		return err
	}
	if !ok {
		key = -1
	}
	_, err = d.pool.Exec(ctx, `SELECT fanout_dead_letter_action($1, $2, $3, $4, $5, $6, $7, $8)`,
		action, l.Subscriber, id, int64(l.Seq), int64(eventSeq(l.Raw)), outcome, comment, key)
	return err
}

// Discard resolves the unresolved letters among ls without handling them,
// and returns how many it resolved and why it left the others. A letter no
// subscriber vouches for (injected, or disagreeing with itself) is
// discarded only with a reason. The event of an ordered subscriber that
// holds its aggregate releases it (in the same transaction as the record):
// the aggregate moves past the event, and the letters held behind it can
// be redriven, in order.
func (d *DeadLetters) Discard(ctx context.Context, ls []Letter, reason string) (n int, left []string, err error) {
	for _, l := range ls {
		if l.Resolved != "" {
			continue
		}
		if !l.Vouched && reason == "" {
			why := "no subscriber vouches for it"
			if l.Refused != "" {
				why = l.Refused
			}
			left = append(left, fmt.Sprintf("%d: %s: discarding it takes --reason", l.Seq, why))
			continue
		}
		if err := d.Record(ctx, "discard", l, "discarded", reason); err != nil {
			return n, left, fmt.Errorf("discard %d: %w", l.Seq, err)
		}
		n++
	}
	return n, left, nil
}

// Redriven is what became of one letter's redrive.
type Redriven struct {
	Letter  Letter
	Outcome string // OutcomeHandled, OutcomeAlreadyHandled, or "failed: ..."
	// Skipped: the letter was resolved already; nothing was done.
	Skipped bool
	// Source is where the event handed to the handler was read from.
	Source string
	Err    error
}

// Redrive hands each unresolved letter's event to its own subscriber's
// runner (runnerOf builds it, once per subscriber) and records each attempt.
// It stops at an error it cannot record; a handler's failure is recorded
// and reported in the letter's Redriven.
func (d *DeadLetters) Redrive(ctx context.Context, ls []Letter, runnerOf func(subscriber string) (*subscribers.Runner, error), fromLetter bool, comment string) ([]Redriven, error) {
	var out []Redriven
	for _, l := range ls {
		if l.Resolved != "" {
			out = append(out, Redriven{Letter: l, Outcome: "already resolved: " + l.Resolved, Skipped: true})
			continue
		}
		outcome := OutcomeHandled
		ev, source, err := d.EventOf(ctx, l, fromLetter)
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
		if rerr := d.Record(ctx, "redrive", l, outcome, comment); rerr != nil {
			return out, fmt.Errorf("record redrive of %d: %w", l.Seq, rerr)
		}
		out = append(out, Redriven{Letter: l, Outcome: outcome, Source: source, Err: err})
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
