package subscribers

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Headers a dead letter carries besides the original message's headers.
const (
	DeadSubscriberHeader = "Fanout-Dead-Subscriber"
	DeadReasonHeader     = "Fanout-Dead-Reason"
	DeadDeliveriesHeader = "Fanout-Dead-Deliveries"
	DeadSubjectHeader    = "Fanout-Dead-Subject"
	DeadStreamSeqHeader  = "Fanout-Dead-Stream-Seq"
	DeadAtHeader         = "Fanout-Dead-At"
)

// DeadLetterStreamConfig is the stream that holds dead letters.
func DeadLetterStreamConfig(cfg Config, replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        cfg.DeadLetterStream,
		Description: "fanout: events a subscriber gave up on, with the original body and headers, the subscriber, the reason and the delivery count",
		Subjects:    []string{cfg.DeadLetterSubjectPrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		MaxAge:      cfg.DeadLetterMaxAge,
		MaxMsgs:     -1,
		MaxBytes:    -1,
		Replicas:    replicas,
		Duplicates:  DeadLetterDuplicateWindow,
		// Dead letters are evidence: they leave only by age. Operators
		// resolve them (fanout dlq redrive/discard, recorded in the
		// dead_letter_actions table) rather than delete them.
		DenyDelete: true,
		DenyPurge:  true,
		Metadata:   map[string]string{"fanout.owner": "fanout provision, or subscribers with subscribers.dead_letter_provision=auto"},
	}
}

// ProvisionDeadLetterStream creates the dead-letter stream, or changes an
// existing one as changes allows (stream.Provision): `fanout provision`
// runs it with the provisioning identity.
func ProvisionDeadLetterStream(ctx context.Context, js jetstream.JetStream, cfg Config, replicas int, changes stream.Changes, logger *slog.Logger) (*jetstream.StreamInfo, error) {
	info, err := stream.Provision(ctx, js, DeadLetterStreamConfig(cfg, replicas), changes, logger)
	if err != nil {
		return nil, fmt.Errorf("provision dead-letter stream %s: %w", cfg.DeadLetterStream, err)
	}
	return info, nil
}

// ensureDeadLetterStream provisions the dead-letter stream (auto), checks
// that it exists (verify), or trusts it (off), per
// subscribers.dead_letter_provision.
func ensureDeadLetterStream(ctx context.Context, js jetstream.JetStream, cfg Config, replicas int, logger *slog.Logger) error {
	switch cfg.DeadLetterProvision {
	case "auto":
		_, err := ProvisionDeadLetterStream(ctx, js, cfg, replicas, stream.Changes{Update: true}, logger)
		return err
	case "verify":
		if _, err := js.Stream(ctx, cfg.DeadLetterStream); err != nil {
			return fmt.Errorf("verify dead-letter stream %s (subscribers.dead_letter_provision=verify; `fanout provision` creates it): %w", cfg.DeadLetterStream, err)
		}
	}
	return nil
}

// deadLetter publishes the delivery to the dead letters with its
// deadReason, then terminates it, and reports whether it did. If the
// publish fails, the dead-letter stream counts as a dependency that is down:
// the event stays in hand, unacked, and is tried again when it answers.
// Nothing is termed before its dead letter has a PubAck.
func (r *Runner) deadLetter(ctx context.Context, d *delivery) bool {
	if err := r.vouch(ctx, d); err != nil {
		r.health.MarkDown(DependencyPostgres, err)
		return false
	}
	if err := r.publishDeadLetter(ctx, d.msg.Data(), d.msg.Headers(), d.msg.Subject(), d.ev.StreamSeq, d.ev.Delivery, d.deadReason, d.heldBy); err != nil {
		r.health.MarkDown(DependencyDeadLetters, fmt.Errorf("publish a dead letter to stream %s: %w", r.cfg.DeadLetterStream, err))
		return false
	}
	r.health.markUp(DependencyDeadLetters)
	// Before the term: a crash between them redelivers the event, which
	// comes back here (its dead letter deduplicated) and records this then.
	if err := r.afterDeadLetter(ctx, d); err != nil {
		r.health.MarkDown(DependencyPostgres, err)
		return false
	}
	termed := true
	for _, m := range d.msgs() {
		if err := m.TermWithReason(truncate(d.deadReason, 200)); err != nil {
			// The dead letter is stored; a redelivery publishes it again,
			// deduplicated by its message id, and terms it then.
			r.logger.Warn("term", "event_id", d.ev.ID, "error", err)
			termed = false
		}
	}
	d.settled.Store(true)
	d.fate.Store(fateTermed)
	r.stall.finished()
	if termed {
		// Kept otherwise: its count sends the redelivery straight back
		// here, without running the handler again.
		r.forgetAttempts(ctx, []*delivery{d})
	}
	r.obs.DeadLettered(r.name, 1)
	r.logger.Error("event dead-lettered", "event_id", d.ev.ID, "event_type", d.ev.Type, "delivery", d.ev.Delivery, "reason", d.deadReason)
	return true
}

// vouch records, as the subscriber's own Postgres role, that it
// dead-letters the event at d's stream sequence: before the letter exists,
// so that every letter this subscriber wrote has its row (row-level
// security lets a role write rows under its own name only), and a letter
// without one was written by someone else (operator.DeadLetters trusts
// only a vouched-for letter's copy of an event).
func (r *Runner) vouch(ctx context.Context, d *delivery) error {
	ctx, cancel := r.bookkeeping(ctx)
	defer cancel()
	digest := LetterDigest(d.msg.Data(), d.msg.Headers(), d.msg.Subject())
	err := r.store.DeadLetterVouch(ctx, bookkeeping.DeadLetterVouchParams{Subscriber: r.name, StreamSeq: int64(d.ev.StreamSeq), EventID: d.ev.ID, Digest: digest})
	if err != nil {
		return fmt.Errorf("record the dead letter in dead_letters: %w", err)
	}
	return nil
}

// LetterDigest is what a subscriber's runtime records of an event it
// dead-letters (dead_letters.digest), and what the operator tools compare a
// letter's copy of the event with: the subject the event was published on,
// the headers an Event is read from (EventFromParts), and the body.
func LetterDigest(data []byte, h nats.Header, subject string) []byte {
	sum := sha256.New()
	for _, v := range []string{subject, h.Get(wire.EventIDHeader), h.Get(wire.EventTypeHeader), h.Get(wire.AggregateTypeHeader),
		h.Get(wire.AggregateIDHeader), h.Get(wire.AggregateSeqHeader), h.Get(wire.CreatedAtHeader)} {
		fmt.Fprintf(sum, "%d:%s\n", len(v), v)
	}
	sum.Write(data)
	return sum.Sum(nil)
}

// DeadBodyOmittedHeader marks a dead letter stored without the event's
// body, which was too large to travel with the dead letter's own headers;
// its value is the body's size. The event is in the events stream at the
// sequence DeadStreamSeqHeader gives, for as long as the stream keeps it.
const DeadBodyOmittedHeader = "Fanout-Dead-Body-Omitted"

func (r *Runner) publishDeadLetter(ctx context.Context, data []byte, headers nats.Header, subject string, seq, deliveries uint64, reason string, heldBy int64) error {
	eventType := strings.TrimPrefix(subject, r.opts.Stream.SubjectPrefix+".")
	msg := nats.NewMsg(r.cfg.DeadLetterSubjectPrefix + "." + r.name + "." + eventType)
	msg.Data = data
	for k, vs := range headers {
		if strings.HasPrefix(k, "Nats-") {
			continue // JetStream's own headers belong to the original message
		}
		msg.Header[k] = vs
	}
	msg.Header.Set(DeadSubscriberHeader, r.name)
	msg.Header.Set(DeadReasonHeader, truncate(reason, 2000))
	msg.Header.Set(DeadDeliveriesHeader, strconv.FormatUint(deliveries, 10))
	msg.Header.Set(DeadSubjectHeader, subject)
	msg.Header.Set(DeadStreamSeqHeader, strconv.FormatUint(seq, 10))
	msg.Header.Set(DeadAtHeader, time.Now().UTC().Format(time.RFC3339Nano))
	if heldBy != 0 {
		msg.Header.Set(DeadHeldByHeader, strconv.FormatInt(heldBy, 10))
	}
	// An event just under max_payload cannot carry the dead letter's own
	// headers as well: stored without its body, the dead letter still says
	// which event and why. Holding it instead would stop the subscriber for
	// good on a letter that can never be published.
	if max := r.opts.Conn.MaxPayload(); max > 0 && int64(msg.Size()) > max {
		msg.Data = nil
		msg.Header.Set(DeadBodyOmittedHeader, strconv.Itoa(len(data)))
	}
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	// One dead letter per subscriber and stream message, however often a
	// crash makes us try.
	_, err := r.js.PublishMsg(pctx, msg,
		jetstream.WithMsgID(r.name+"."+strconv.FormatUint(seq, 10)),
		jetstream.WithExpectStream(r.cfg.DeadLetterStream))
	return err
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

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
func Receives(ctx context.Context, js jetstream.JetStream, stream stream.Config, subscriber, subject string) error {
	cons, err := js.Consumer(ctx, stream.Name, subscriber)
	if err != nil {
		return fmt.Errorf("subscriber %s has no consumer on %s: %v", subscriber, stream.Name, err)
	}
	cc := cons.CachedInfo().Config
	filters := cc.FilterSubjects
	if cc.FilterSubject != "" {
		filters = append(filters, cc.FilterSubject)
	}
	if len(filters) > 0 && !slices.ContainsFunc(filters, func(f string) bool { return SubjectMatches(f, subject) }) {
		return fmt.Errorf("it names an event on %s, which subscriber %s does not receive (its filters: %v)", subject, subscriber, filters)
	}
	return nil
}

// SubjectMatches reports whether subject matches the NATS pattern ('*' one
// token, '>' one or more).
func SubjectMatches(pattern, subject string) bool {
	pt, st := strings.Split(pattern, "."), strings.Split(subject, ".")
	for i, tok := range pt {
		if tok == ">" {
			return len(st) > i
		}
		if i >= len(st) || (tok != "*" && tok != st[i]) {
			return false
		}
	}
	return len(pt) == len(st)
}
