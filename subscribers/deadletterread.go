package subscribers

// Dead letters as the operator tools read them: parsed, and checked
// against the events stream before anything acts on them.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go/jetstream"
)

// DeadLetter is a dead letter as operator tools read it.
type DeadLetter struct {
	Seq uint64
	// Subscriber is whose letter it is, taken from the subject it is
	// stored under (<prefix>.<subscriber>.<event_type>): a subscriber's
	// NATS user may publish only under its own name, while the headers are
	// whatever the publisher wrote.
	Subscriber string
	// Event is the event the letter stands for: after Verify, the copy in
	// the events stream; before, the letter's own.
	Event      Event
	Reason     string
	Deliveries string
	At         string
	// Verified: Event was read from the events stream at the sequence the
	// letter names, and is one the subscriber's consumer wants.
	Verified bool
	Raw      *jetstream.RawStreamMsg
}

// ErrDeadLetterRefused is wrapped by the errors of ParseDeadLetter and
// Verify: a letter that disagrees with itself or with the events stream
// must not be acted on (a redrive writes the named subscriber's checkpoint,
// so a forged letter could make it skip a real event).
var ErrDeadLetterRefused = errors.New("dead letter refused")

// ParseDeadLetter reads m, a message of the dead-letter stream. It refuses
// a letter stored outside cfg's subject prefix, or whose subscriber header
// names another subscriber than its subject.
func ParseDeadLetter(m *jetstream.RawStreamMsg, cfg Config, stream stream.Config) (DeadLetter, error) {
	h := m.Header
	dl := DeadLetter{Seq: m.Sequence, Reason: h.Get(DeadReasonHeader), Deliveries: h.Get(DeadDeliveriesHeader), At: h.Get(DeadAtHeader), Raw: m}
	rest, ok := strings.CutPrefix(m.Subject, cfg.DeadLetterSubjectPrefix+".")
	name, _, _ := strings.Cut(rest, ".")
	if !ok || name == "" {
		return dl, fmt.Errorf("%w: letter %d is stored under %s, outside %s.<subscriber>.>", ErrDeadLetterRefused, m.Sequence, m.Subject, cfg.DeadLetterSubjectPrefix)
	}
	dl.Subscriber = name
	ev, err := EventFromParts(m.Data, h, h.Get(DeadSubjectHeader), stream.SubjectPrefix)
	dl.Event = ev
	if claimed := h.Get(DeadSubscriberHeader); claimed != name {
		return dl, fmt.Errorf("%w: letter %d is stored under subscriber %s but its %s header says %q: only %s could have written it, and it may not speak for another",
			ErrDeadLetterRefused, m.Sequence, name, DeadSubscriberHeader, claimed, name)
	}
	if err != nil {
		return dl, fmt.Errorf("%w: letter %d: %v", ErrDeadLetterRefused, m.Sequence, err)
	}
	return dl, nil
}

// Verify reads the event the letter names (by its stream sequence) from the
// events stream and checks that it is the same event (id and subject) and
// one the subscriber's consumer wants; dl.Event becomes that copy. An event
// the stream no longer holds (past stream.max_age) returns an error wrapping
// jetstream.ErrMsgNotFound: the caller decides whether to trust the letter.
func (dl *DeadLetter) Verify(ctx context.Context, js jetstream.JetStream, stream stream.Config) error {
	seq, err := strconv.ParseUint(dl.Raw.Header.Get(DeadStreamSeqHeader), 10, 64)
	if err != nil || seq == 0 {
		return fmt.Errorf("%w: letter %d names no stream sequence (%s)", ErrDeadLetterRefused, dl.Seq, DeadStreamSeqHeader)
	}
	events, err := js.Stream(ctx, stream.Name)
	if err != nil {
		return fmt.Errorf("verify letter %d: stream %s: %w", dl.Seq, stream.Name, err)
	}
	m, err := events.GetMsg(ctx, seq)
	if err != nil {
		return fmt.Errorf("verify letter %d: event at %s sequence %d: %w", dl.Seq, stream.Name, seq, err)
	}
	orig, err := EventFromParts(m.Data, m.Header, m.Subject, stream.SubjectPrefix)
	if err != nil || orig.ID != dl.Event.ID || m.Subject != dl.Raw.Header.Get(DeadSubjectHeader) {
		return fmt.Errorf("%w: letter %d names event %d on %s at %s sequence %d, which holds event %d on %s",
			ErrDeadLetterRefused, dl.Seq, dl.Event.ID, dl.Raw.Header.Get(DeadSubjectHeader), stream.Name, seq, orig.ID, m.Subject)
	}
	if err := Receives(ctx, js, stream, dl.Subscriber, m.Subject); err != nil {
		return fmt.Errorf("%w: letter %d: %v", ErrDeadLetterRefused, dl.Seq, err)
	}
	orig.StreamSeq = seq
	dl.Event, dl.Verified = orig, true
	return nil
}

// Receives says, from its consumer's filters, whether subscriber receives
// events on subject (nil), or why not.
func Receives(ctx context.Context, js jetstream.JetStream, events stream.Config, subscriber, subject string) error {
	cons, err := js.Consumer(ctx, events.Name, subscriber)
	if err != nil {
		return fmt.Errorf("subscriber %s has no consumer on %s: %v", subscriber, events.Name, err)
	}
	cc := cons.CachedInfo().Config
	filters := cc.FilterSubjects
	if cc.FilterSubject != "" {
		filters = append(filters, cc.FilterSubject)
	}
	if len(filters) > 0 && !slices.ContainsFunc(filters, func(f string) bool { return stream.SubjectMatches(f, subject) }) {
		return fmt.Errorf("it names an event on %s, which subscriber %s does not receive (its filters: %v)", subject, subscriber, filters)
	}
	return nil
}
