package relay

import (
	"context"
	"fmt"

	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go/jetstream"
)

// A stream's own limits (max_age, max_bytes) remove its oldest events. An
// event removed before every consumer it belongs to acknowledged it is
// lost for the subscribers behind those consumers, and nothing says so:
// their consumers skip to the stream's first sequence. The audit checks
// each event below the first sequence against the consumers' ack floors,
// and takes one that some consumer whose filters name its subject had not
// acknowledged for missing: it is published again from its row, and the
// subscribers that had it take the copy as the duplicate it is.

// ackingConsumer is what the audit needs of a consumer of the stream.
type ackingConsumer struct {
	name     string
	ackFloor uint64
	filters  []string // none: the whole stream
}

func (c ackingConsumer) wants(subject string) bool {
	if len(c.filters) == 0 {
		return true
	}
	for _, f := range c.filters {
		if stream.SubjectMatches(f, subject) {
			return true
		}
	}
	return false
}

// ackingConsumers lists the stream's consumers that acknowledge what they
// get (the subscribers'; the readers acknowledge nothing).
func ackingConsumers(ctx context.Context, s jetstream.Stream) ([]ackingConsumer, error) {
	var cs []ackingConsumer
	list := s.ListConsumers(ctx)
	for info := range list.Info() {
		if info.Config.AckPolicy == jetstream.AckNonePolicy {
			continue
		}
		c := ackingConsumer{name: info.Name, ackFloor: info.AckFloor.Stream, filters: info.Config.FilterSubjects}
		if f := info.Config.FilterSubject; f != "" {
			c.filters = append(c.filters, f)
		}
		cs = append(cs, c)
	}
	if err := list.Err(); err != nil {
		return nil, fmt.Errorf("list the consumers of stream %s: %w", s.CachedInfo().Config.Name, err)
	}
	return cs, nil
}

// unconsumed returns the events of aged (below the stream's first
// sequence, in sequence order) that a consumer of the stream whose filters
// name them had not acknowledged.
func (a *auditor) unconsumed(ctx context.Context, s jetstream.Stream, aged []outboxstore.Landed) ([]outboxstore.Landed, error) {
	if len(aged) == 0 {
		return nil, nil
	}
	cs, err := ackingConsumers(ctx, s)
	if err != nil {
		return nil, err
	}
	// Most audits end here: every consumer is past every aged event.
	var behind []ackingConsumer
	for _, c := range cs {
		if c.ackFloor < aged[len(aged)-1].Seq {
			behind = append(behind, c)
		}
	}
	if len(behind) == 0 {
		return nil, nil
	}
	byID := make(map[int64]outboxstore.Landed, len(aged))
	var ids []int64
	for _, l := range aged {
		for _, c := range behind {
			if l.Seq > c.ackFloor {
				byID[l.ID] = l
				ids = append(ids, l.ID)
				break
			}
		}
	}
	var lost []outboxstore.Landed
	missed := map[string]int{}
	for len(ids) > 0 {
		part := ids[:min(len(ids), a.cfg.BatchSize)]
		ids = ids[len(part):]
		rows, err := a.store.Rows(ctx, part)
		if err != nil {
			return nil, err
		}
		found := make(map[int64]bool, len(rows))
		for _, rw := range rows {
			found[rw.ID] = true
			l, subject := byID[rw.ID], stream.Subject(a.stream.SubjectPrefix, rw.EventType)
			hit := false
			for _, c := range behind {
				if l.Seq > c.ackFloor && c.wants(subject) {
					missed[c.name]++
					hit = true
				}
			}
			if hit {
				lost = append(lost, l)
			}
		}
		// A row gone with its range: its subject is unknown, and the
		// repair reports it lost.
		for _, id := range part {
			if !found[id] {
				lost = append(lost, byID[id])
			}
		}
	}
	for name, n := range missed {
		a.logger.Error("audit: events left the stream (its limits removed them) before a consumer acknowledged them: missing for its subscriber",
			"consumer", name, "events", n)
	}
	return lost, nil
}
