package subscribers

// What a runner checks of its surroundings while it runs (every
// stream.check_interval): the streams and its consumer against the
// configuration, and, for an ordered subscriber, the outbox's numbering of
// the event types it reads. Readiness reports what they find.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// configWatch finds what the live streams and the subscriber's consumer
// differ in from the configuration.
type configWatch struct {
	name       string
	eventTypes []string
	ordered    bool
	cfg        Config
	streamCfg  stream.Config
	js         jetstream.JetStream
	logger     *slog.Logger
	// drift is what they differ in, as of the last check.
	drift *stream.Drift
	// events and bound are the events stream and the consumer the
	// runner bound at its start.
	events jetstream.Stream
	bound  jetstream.Consumer
	// pastTheEnd marks the consumer moved past the stream's end.
	pastTheEnd stream.PastTheEndWatch
}

// check compares the live streams and the subscriber's consumer with the
// configuration. A check that gets no answer changes nothing.
func (w *configWatch) check(ctx context.Context) {
	want := map[string]jetstream.StreamConfig{w.streamCfg.Name: stream.JetStreamConfig(w.streamCfg)}
	if w.cfg.DeadLetterProvision != "off" {
		want[w.cfg.DeadLetterStream] = DeadLetterStreamConfig(w.cfg, w.streamCfg.Replicas)
	}
	for name, sc := range want {
		s, err := w.js.Stream(ctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			w.drift.Set("stream "+name, stream.Missing)
			continue
		}
		if err != nil {
			w.logger.Debug("stream check: no answer", "stream", name, "error", err)
			continue
		}
		w.drift.Set("stream "+name, stream.StreamDifferences(s.CachedInfo().Config, sc))
	}
	object := "consumer " + w.name
	c, err := w.events.Consumer(ctx, w.name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		w.drift.Set(object, stream.Missing)
		return
	}
	if err != nil {
		w.logger.Debug("consumer check: no answer", "consumer", w.name, "error", err)
		return
	}
	info := c.CachedInfo()
	ds := stream.ConsumerDifferences(info.Config, ConsumerConfig(w.name, w.eventTypes, w.ordered, w.cfg, w.streamCfg))
	// A consumer made again since this subscriber bound it may start
	// anywhere (its start position is not compared): say so until a
	// restart binds the new one.
	if bound := w.bound.CachedInfo().Created; !info.Created.Equal(bound) {
		ds = append(ds, stream.Difference{Field: "created", Have: info.Created.UTC().Format(time.RFC3339Nano), Want: bound.UTC().Format(time.RFC3339Nano) + " (the consumer this subscriber bound at start: it was deleted and made again since, and may start elsewhere)"})
	}
	// Moved past the stream's end (a reset to a sequence not yet
	// written), the consumer skips every event up to there and reports
	// nothing pending. The stream is read after the consumer, so a
	// consumer keeping up is never past it. Unread, the stream's end
	// leaves that mark as it was.
	si, err := w.events.Info(ctx)
	if err != nil {
		w.logger.Debug("stream check: no answer", "stream", w.streamCfg.Name, "error", err)
		w.drift.Set(object, append(ds, w.pastTheEnd.Held(w.name)...))
		return
	}
	past := w.pastTheEnd.Round([]*jetstream.ConsumerInfo{info}, si.State.LastSeq)
	w.drift.Set(object, append(ds, past[w.name]...))
}

// numbering watches, for an ordered subscriber, that the outbox numbers
// every event type it reads.
type numbering struct {
	name       string
	eventTypes []string
	pool       *pgxpool.Pool
	logger     *slog.Logger
	// unnumbered lists, as of watch's last look, the event types the
	// subscriber reads that the outbox does not number.
	unnumbered atomic.Pointer[string]
}

// err says which event types the subscriber reads unnumbered, or nil.
func (n *numbering) err() error {
	if p := n.unnumbered.Load(); p != nil && *p != "" {
		return fmt.Errorf("subscriber %s is ordered, and the outbox does not number %s, which it reads (fanout outbox numbering)", n.name, *p)
	}
	return nil
}

// check refuses an ordered subscriber that reads an event type the
// outbox does not number (outboxstore.Store.SetNumbering): its events
// would come with no number and in no order.
func (n *numbering) check(ctx context.Context, tx pgx.Tx) error {
	skipped, err := outbox.Unnumbered(ctx, tx)
	if errors.Is(err, outbox.ErrNoNumbering) {
		return refusedStart{fmt.Errorf("subscriber %s is ordered: %w", n.name, err)}
	}
	if err != nil {
		return err // checkStore judges it: Postgres unreachable is waited out
	}
	if read := n.read(skipped); len(read) > 0 {
		return refusedStart{fmt.Errorf("subscriber %s is ordered, but the outbox does not number %s, which it reads: "+
			"number them again (fanout outbox numbering, with --skip not naming them)", n.name, strings.Join(read, ", "))}
	}
	return nil
}

// read returns the types of skipped (the outbox does not number
// them) that the subscriber reads, by name or by a pattern.
func (n *numbering) read(skipped []string) []string {
	var read []string
	for _, t := range skipped {
		if slices.ContainsFunc(n.eventTypes, func(p string) bool { return stream.SubjectMatches(p, t) }) {
			read = append(read, t)
		}
	}
	return read
}

// watch looks again, while an ordered subscriber runs, at the event types
// the outbox does not number (check looked at start):
// one it reads, skipped since (by a fanout binary that does not know this
// subscriber), comes with no number and in no order. The subscriber then
// reports not ready and logs an error, until the type is numbered again.
func (n *numbering) watch(ctx context.Context) {
	skipped, err := outbox.Unnumbered(ctx, n.pool)
	if err != nil {
		n.logger.Debug("numbering check: no answer", "error", err)
		return
	}
	read := strings.Join(n.read(skipped), ", ")
	var was string
	if p := n.unnumbered.Swap(&read); p != nil {
		was = *p
	}
	switch {
	case read != "" && read != was:
		n.logger.Error("the outbox no longer numbers event types this ordered subscriber reads: their events come with no number, in no order; this subscriber reports not ready until they are numbered again (fanout outbox numbering)",
			"event_types", read)
	case read == "" && was != "":
		n.logger.Info("the outbox numbers every event type this ordered subscriber reads again", "event_types", was)
	}
}
