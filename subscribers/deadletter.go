package subscribers

// The dead letters: their stream, and how a runner sends an event there.

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
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

// deadLetters sends one runner's events to the dead letters: each vouched
// for in dead_letters, published with its reason, its aggregate held (or
// let pass) if the subscriber is ordered, then termed.
type deadLetters struct {
	name          string
	cfg           Config
	subjectPrefix string // the events stream's (stream.subject_prefix)
	js            jetstream.JetStream
	conn          *nats.Conn // its max_payload bounds a letter
	store         bookkeeping.Store
	attempts      *attempts
	aggregates    *aggregates // nil but for an ordered subscriber
	stall         *stallWatch
	obs           Observer
	logger        *slog.Logger
	health        *Health // the runner's, from its start
}

// send publishes the delivery to the dead letters with its deadReason,
// then terminates it, and reports whether it did. If the publish fails,
// the dead-letter stream counts as a dependency that is down: the event
// stays in hand, unacked, and is tried again when it answers. Nothing is
// termed before its dead letter has a PubAck.
func (dl *deadLetters) send(ctx context.Context, d *delivery) bool {
	if err := dl.vouch(ctx, d); err != nil {
		dl.health.MarkDown(DependencyPostgres, err)
		return false
	}
	if err := dl.publish(ctx, d.msg.Data(), d.msg.Headers(), d.msg.Subject(), d.ev.StreamSeq, d.ev.Delivery, d.deadReason, d.heldBy); err != nil {
		dl.health.MarkDown(DependencyDeadLetters, fmt.Errorf("publish a dead letter to stream %s: %w", dl.cfg.DeadLetterStream, err))
		return false
	}
	dl.health.markUp(DependencyDeadLetters)
	// Before the term: a crash between them redelivers the event, which
	// comes back here (its dead letter deduplicated) and records this then.
	if dl.aggregates != nil {
		if err := dl.aggregates.afterDeadLetter(ctx, d); err != nil {
			dl.health.MarkDown(DependencyPostgres, err)
			return false
		}
	}
	termed := true
	for _, m := range d.msgs() {
		if err := m.TermWithReason(truncate(d.deadReason, 200)); err != nil {
			// The dead letter is stored; a redelivery publishes it again,
			// deduplicated by its message id, and terms it then.
			dl.logger.Warn("term", "event_id", d.ev.ID, "error", err)
			termed = false
		}
	}
	d.settled.Store(true)
	d.fate.Store(fateTermed)
	dl.stall.finished()
	if termed {
		// Kept otherwise: its count sends the redelivery straight back
		// here, without running the handler again.
		dl.attempts.forget(ctx, []*delivery{d})
	}
	dl.obs.DeadLettered(dl.name, 1)
	dl.logger.Error("event dead-lettered", "event_id", d.ev.ID, "event_type", d.ev.Type, "delivery", d.ev.Delivery, "reason", d.deadReason)
	return true
}

// vouch records, as the subscriber's own Postgres role, that it
// dead-letters the event at d's stream sequence: before the letter exists,
// so that every letter this subscriber wrote has its row (row-level
// security lets a role write rows under its own name only), and a letter
// without one was written by someone else (operator.DeadLetters trusts
// only a vouched-for letter's copy of an event).
func (dl *deadLetters) vouch(ctx context.Context, d *delivery) error {
	ctx, cancel := bounded(ctx, dl.cfg)
	defer cancel()
	digest := LetterDigest(d.msg.Data(), d.msg.Headers(), d.msg.Subject())
	err := dl.store.DeadLetterVouch(ctx, bookkeeping.DeadLetterVouchParams{Subscriber: dl.name, StreamSeq: int64(d.ev.StreamSeq), EventID: d.ev.ID, Digest: digest})
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

// publish publishes the event at stream sequence seq (its body, headers
// and subject) as a dead letter, with the reason.
func (dl *deadLetters) publish(ctx context.Context, data []byte, headers nats.Header, subject string, seq, deliveries uint64, reason string, heldBy int64) error {
	eventType := strings.TrimPrefix(subject, dl.subjectPrefix+".")
	msg := nats.NewMsg(dl.cfg.DeadLetterSubjectPrefix + "." + dl.name + "." + eventType)
	msg.Data = data
	for k, vs := range headers {
		if strings.HasPrefix(k, "Nats-") {
			continue // JetStream's own headers belong to the original message
		}
		msg.Header[k] = vs
	}
	msg.Header.Set(DeadSubscriberHeader, dl.name)
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
	if max := dl.conn.MaxPayload(); max > 0 && int64(msg.Size()) > max {
		msg.Data = nil
		msg.Header.Set(DeadBodyOmittedHeader, strconv.Itoa(len(data)))
	}
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	// One dead letter per subscriber and stream message, however often a
	// crash makes us try.
	_, err := dl.js.PublishMsg(pctx, msg,
		jetstream.WithMsgID(dl.name+"."+strconv.FormatUint(seq, 10)),
		jetstream.WithExpectStream(dl.cfg.DeadLetterStream))
	return err
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
