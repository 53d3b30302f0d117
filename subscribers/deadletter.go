package subscribers

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/config"
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
func DeadLetterStreamConfig(cfg config.Subscribers, replicas int) jetstream.StreamConfig {
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
		Duplicates:  config.DeadLetterDuplicateWindow,
		Metadata:    map[string]string{"fanout.owner": "fanout subscribers (stream.provision=auto)"},
	}
}

func ensureDeadLetterStream(ctx context.Context, js jetstream.JetStream, cfg config.Subscribers, replicas int, provision string) error {
	switch provision {
	case "auto":
		if _, err := js.CreateOrUpdateStream(ctx, DeadLetterStreamConfig(cfg, replicas)); err != nil {
			return fmt.Errorf("provision dead-letter stream %s: %w", cfg.DeadLetterStream, err)
		}
	case "verify":
		if _, err := js.Stream(ctx, cfg.DeadLetterStream); err != nil {
			return fmt.Errorf("verify dead-letter stream %s (stream.provision=verify): %w", cfg.DeadLetterStream, err)
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
	if err := r.publishDeadLetter(ctx, d.msg.Data(), d.msg.Headers(), d.msg.Subject(), d.ev.StreamSeq, d.ev.Delivery, d.deadReason); err != nil {
		r.health.markDown(DependencyDeadLetters, fmt.Errorf("publish a dead letter to stream %s: %w", r.cfg.DeadLetterStream, err))
		return false
	}
	r.health.markUp(DependencyDeadLetters)
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
	if termed {
		// Kept otherwise: its count sends the redelivery straight back
		// here, without running the handler again.
		r.forgetAttempts(ctx, []*delivery{d})
	}
	r.obs.DeadLettered(r.name, 1)
	r.logger.Error("event dead-lettered", "event_id", d.ev.ID, "event_type", d.ev.Type, "delivery", d.ev.Delivery, "reason", d.deadReason)
	return true
}

// DeadBodyOmittedHeader marks a dead letter stored without the event's
// body, which was too large to travel with the dead letter's own headers;
// its value is the body's size. The event is in the events stream at the
// sequence DeadStreamSeqHeader gives, for as long as the stream keeps it.
const DeadBodyOmittedHeader = "Fanout-Dead-Body-Omitted"

func (r *Runner) publishDeadLetter(ctx context.Context, data []byte, headers nats.Header, subject string, seq, deliveries uint64, reason string) error {
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
