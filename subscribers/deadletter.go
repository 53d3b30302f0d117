package subscribers

import (
	"context"
	"encoding/json"
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
		Duplicates:  2 * time.Minute,
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

// deadLetter publishes the delivery to the dead letters, then terminates
// it. If the publish fails, the event is naked instead: it must not vanish.
func (r *Runner) deadLetter(ctx context.Context, d delivery, reason string) {
	if err := r.publishDeadLetter(ctx, d.msg.Data(), d.msg.Headers(), d.msg.Subject(), d.ev.StreamSeq, d.ev.Delivery, reason); err != nil {
		r.logger.Error("publish dead letter; the event will be redelivered", "event_id", d.ev.ID, "error", err)
		_ = d.msg.NakWithDelay(r.cfg.RetryMin)
		r.obs.Retried(r.name, 1)
		return
	}
	if err := d.msg.TermWithReason(truncate(reason, 200)); err != nil {
		r.logger.Warn("term", "event_id", d.ev.ID, "error", err)
	}
	r.obs.DeadLettered(r.name, 1)
	r.logger.Error("event dead-lettered", "event_id", d.ev.ID, "event_type", d.ev.Type, "delivery", d.ev.Delivery, "reason", reason)
}

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
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	// One dead letter per subscriber and stream message, however often a
	// crash makes us try.
	_, err := r.js.PublishMsg(pctx, msg,
		jetstream.WithMsgID(r.name+"."+strconv.FormatUint(seq, 10)),
		jetstream.WithExpectStream(r.cfg.DeadLetterStream))
	return err
}

// onMaxDeliveries dead-letters an event that JetStream stopped delivering
// without any outcome (its last delivery timed out).
func (r *Runner) onMaxDeliveries(m *nats.Msg) {
	var adv struct {
		StreamSeq  uint64 `json:"stream_seq"`
		Deliveries uint64 `json:"deliveries"`
	}
	if err := json.Unmarshal(m.Data, &adv); err != nil || adv.StreamSeq == 0 {
		r.logger.Warn("unreadable max-deliveries advisory", "error", err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw, err := r.stream.GetMsg(ctx, adv.StreamSeq)
	if err != nil {
		r.logger.Error("max deliveries reached but the event cannot be read", "stream_seq", adv.StreamSeq, "error", err)
		return
	}
	reason := fmt.Sprintf("no outcome after %d deliveries (the last one timed out)", adv.Deliveries)
	if err := r.publishDeadLetter(ctx, raw.Data, raw.Header, raw.Subject, adv.StreamSeq, adv.Deliveries, reason); err != nil {
		r.logger.Error("publish dead letter after max deliveries", "stream_seq", adv.StreamSeq, "error", err)
		return
	}
	r.obs.DeadLettered(r.name, 1)
	r.logger.Error("event dead-lettered", "stream_seq", adv.StreamSeq, "reason", reason)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
