package faultrun

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
)

// check verifies the invariants after the drain; each violation names the
// event ids involved. Every read it makes is checked: a checker that
// cannot read something reports that, it never passes by default.
func (r *run) check() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep := r.report
	rep.Planted = r.planted.kinds

	stream, err := r.readStream(ctx)
	if err != nil {
		rep.violate("1 (read the stream)", err.Error())
		return
	}
	rep.Events = uint64(len(stream.bySeq))
	r.checkOutbox(ctx, stream)

	dead, err := r.deadLetters(ctx)
	if err != nil {
		rep.violate("5 (read the dead letters)", err.Error())
		return
	}
	r.checkDeadLetters(ctx, dead, stream)
	r.checkDelivered(ctx, stream, dead)
	r.checkBackfill(ctx)
	r.checkInvoices(ctx)
	r.checkLedger(ctx)
	r.checkFulfilment(ctx)
	r.checkOrderStatus(ctx)
	r.checkSearch(ctx)
	r.checkCache(ctx)
}

// checkDelivered: every event in the stream for a subscriber's filter is in
// its checkpoint or its dead letters.
func (r *run) checkDelivered(ctx context.Context, stream *streamContents, dead []deadLetter) {
	rep := r.report
	deadIDs := map[string]map[int64]bool{}
	for _, dl := range dead {
		if deadIDs[dl.subscriber] == nil {
			deadIDs[dl.subscriber] = map[int64]bool{}
		}
		deadIDs[dl.subscriber][dl.id] = true
	}
	for _, name := range r.subscriberNames() {
		rows, err := r.pool().Query(ctx, `SELECT event_id FROM processed_events WHERE subscriber = $1`, name)
		if err != nil {
			rep.violate("1 (read the checkpoint of "+name+")", err.Error())
			continue
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			rep.violate("1 (read the checkpoint of "+name+")", err.Error())
			continue
		}
		done := make(map[int64]bool, len(ids))
		for _, id := range ids {
			done[id] = true
		}
		var missing []string
		wanted := 0
		for _, ev := range stream.bySeq {
			if filters, _ := r.filters(name); !matchesAny(filters, strings.TrimPrefix(ev.subj, "events.")) {
				continue
			}
			if r.missedByLate(name, ev.seq) {
				continue // the backfill's, checked by its effects
			}
			wanted++
			if !done[ev.id] && !deadIDs[name][ev.id] {
				missing = append(missing, r.describeMissed(ev))
			}
		}
		if wanted == 0 {
			rep.violate("1 ("+name+")", "no event in the stream matches its filters: the check proves nothing")
		}
		if len(missing) > 0 {
			rep.violate("1 (every event checkpointed or dead-lettered)", fmt.Sprintf("%s: %d of %d events neither: %s (%s)", name, len(missing), wanted, head(missing), r.consumerState(ctx, name)))
		}
	}
}

// describeMissed names an event a subscriber has neither handled nor
// dead-lettered with where the stream holds it: what tells a consumer
// that skipped it from one that never got there.
func (r *run) describeMissed(ev event) string {
	s := fmt.Sprintf("%d (seq %d", ev.id, ev.seq)
	if ev.repairedFrom != "" {
		s += ", published again, lost from " + ev.repairedFrom
	}
	if ev.tx != "" {
		s += ", tx " + ev.tx
	}
	return s + ")"
}

// consumerState is what JetStream says of a subscriber's consumer and
// the sequences the run's store rollbacks took away.
func (r *run) consumerState(ctx context.Context, name string) string {
	r.lostMu.Lock()
	lost := fmt.Sprint(r.lostSpans)
	r.lostMu.Unlock()
	c, err := r.js.Consumer(ctx, "EVENTS", name)
	if err != nil {
		return "its consumer: " + err.Error() + "; sequences lost to rollbacks " + lost
	}
	info, err := c.Info(ctx)
	if err != nil {
		return "its consumer: " + err.Error() + "; sequences lost to rollbacks " + lost
	}
	return fmt.Sprintf("its consumer: delivered through seq %d, acked through %d, %d pending, %d ack pending, %d redelivered; sequences lost to rollbacks %s",
		info.Delivered.Stream, info.AckFloor.Stream, info.NumPending, info.NumAckPending, info.NumRedelivered, lost)
}

// matchesAny reports whether subject matches one of the NATS subject
// patterns.
func matchesAny(patterns []string, subject string) bool {
	return slices.ContainsFunc(patterns, func(p string) bool { return stream.SubjectMatches(p, subject) })
}

func head(xs []string) string {
	if len(xs) > 10 {
		return strings.Join(xs[:10], ", ") + fmt.Sprintf(" and %d more", len(xs)-10)
	}
	return strings.Join(xs, ", ")
}

func cut[T any](xs []T) []T {
	if len(xs) > 10 {
		return xs[:10]
	}
	return xs
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
