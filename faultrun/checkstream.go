package faultrun

// The stream against the outbox: every committed row sent or failed,
// every sent row in the stream once, each aggregate's events in order.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// event is one stream message.
type event struct {
	id   int64
	seq  uint64
	subj string
	typ  string
	body []byte
	// repairedFrom: the sequence a copy the auditor published again was
	// lost from (wire.RepairedHeader), or "" for a first publish.
	repairedFrom string
	// tx: with relay.atomic transaction, the transaction and chunk the
	// relay says the event's batch carried (wire.TxHeader, ...).
	tx string
}

// streamContents is the whole events stream, read to its last sequence.
type streamContents struct {
	// bySeq: this run's database's events, in stream order.
	bySeq []event
	// byID maps an event id to the sequences holding it: the event of
	// this run's database with that id. An event's identity is its origin
	// and its id; messages of any other origin are in foreign.
	byID    map[int64][]uint64
	foreign []string
}

// readPatience is how long reading a stream rides out a cluster that is
// not answering yet.
const readPatience = 2 * time.Minute

// readStream reads every message of EVENTS up to the last sequence the
// stream reports, and fails unless it got all of them.
func (r *run) readStream(ctx context.Context) (*streamContents, error) {
	start := time.Now()
	var s jetstream.Stream
	var info *jetstream.StreamInfo
	err := tryEverySecond(func() bool { return time.Since(start) > readPatience }, func(ictx context.Context) error {
		var err error
		if s, err = r.js.Stream(ictx, "EVENTS"); err == nil {
			info, err = s.Info(ictx)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	out := &streamContents{byID: map[int64][]uint64{}}
	ident, err := outboxstore.New(r.pool()).ReadIdentity(ctx)
	if err != nil {
		return nil, err
	}
	if info.State.Msgs == 0 {
		return out, nil
	}
	if err := r.fetchStream(ctx, s, info.State.LastSeq, ident, out); err != nil {
		return nil, err
	}
	if uint64(len(out.bySeq)+len(out.foreign)) != info.State.Msgs {
		return nil, fmt.Errorf("read %d messages, the stream reports %d", len(out.bySeq)+len(out.foreign), info.State.Msgs)
	}
	return out, nil
}

// fetchStream reads s's messages up to lastSeq into out. A cluster may
// still be electing leaders after the heal: a request that finds no
// responder, or times out, is tried again (for up to readPatience) from
// the sequence after the last one read, so nothing is read twice or
// skipped.
func (r *run) fetchStream(ctx context.Context, s jetstream.Stream, lastSeq uint64, ident *outbox.Identity, out *streamContents) error {
	deadline := time.Now().Add(readPatience)
	var oc jetstream.Consumer
	last := uint64(0)
	retry := func(err error) error {
		if time.Now().After(deadline) {
			return fmt.Errorf("fetch after sequence %d: %w", last, err)
		}
		r.o.Logf("chaos: reading the stream after sequence %d: %v (tried again)", last, err)
		oc = nil
		time.Sleep(time.Second)
		return nil
	}
	for last < lastSeq {
		if oc == nil {
			cfg := jetstream.OrderedConsumerConfig{}
			if last > 0 {
				cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, last+1
			}
			var err error
			if oc, err = s.OrderedConsumer(ctx, cfg); err != nil {
				if err := retry(err); err != nil {
					return err
				}
				continue
			}
		}
		batch, err := oc.Fetch(1000, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			if err := retry(err); err != nil {
				return err
			}
			continue
		}
		n := 0
		for m := range batch.Messages() {
			n++
			if last, err = out.add(m, ident); err != nil {
				return err
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			if err := retry(err); err != nil {
				return err
			}
			continue
		}
		if n == 0 {
			if err := retry(fmt.Errorf("the stream reports messages up to sequence %d, but nothing came", lastSeq)); err != nil {
				return err
			}
		}
	}
	return nil
}

// add files message m under this run's events, or under foreign, and
// returns its stream sequence.
func (c *streamContents) add(m jetstream.Msg, ident *outbox.Identity) (uint64, error) {
	md, err := m.Metadata()
	if err != nil {
		return 0, err
	}
	seq := md.Sequence.Stream
	id, err := strconv.ParseInt(m.Headers().Get(wire.EventIDHeader), 10, 64)
	if err != nil {
		return seq, fmt.Errorf("message %d carries no event id: %w", seq, err)
	}
	if o := m.Headers().Get(wire.OriginHeader); o != ident.OriginOf(id) {
		// Not this run's event, whatever its id: kept out of every
		// other check (invariant 10 reports it).
		c.foreign = append(c.foreign, fmt.Sprintf("sequence %d: event %d of origin %q, not %q", seq, id, o, ident.OriginOf(id)))
		return seq, nil
	}
	c.bySeq = append(c.bySeq, event{id: id, seq: seq, subj: m.Subject(), typ: m.Headers().Get(wire.EventTypeHeader), body: m.Data(),
		repairedFrom: m.Headers().Get(wire.RepairedHeader),
		tx:           txOf(m.Headers())})
	c.byID[id] = append(c.byID[id], seq)
	return seq, nil
}

// outboxRows is what checkOutbox finds, row by row, in the outbox.
type outboxRows struct {
	notSent, unexpectedFailed, missing, twice, failedPublished []string
	// wronglyNumbered: rows of a type the outbox does not number, with a
	// number.
	wronglyNumbered []string
	sent            map[int64]bool
	numbered        map[int64]aggregateEvent
	skipped         map[int64]bool // of a type the outbox does not number
}

// checkOutbox: every committed outbox row is sent (and then in the stream
// exactly once) or failed with a reason, and only the planted rows failed;
// the stream holds nothing that is not a sent row.
func (r *run) checkOutbox(ctx context.Context, stream *streamContents) {
	rep := r.report
	var err error
	if rep.Ranges, rep.SealedRanges, rep.DefaultRows, err = outboxstore.New(r.pool()).RangeCounts(ctx); err != nil {
		rep.violate("1 (read the outbox's ranges)", err.Error())
		return
	}
	rows, err := r.readOutboxRows(ctx, stream)
	if err != nil {
		rep.violate("1 (read the outbox)", err.Error())
		return
	}
	r.reportOutboxRows(rows, stream)
	r.checkAggregateOrder(stream, rows.sent, rows.numbered, rows.skipped)
	if r.o.Atomic == relay.AtomicTransaction {
		r.checkTransactions(ctx, stream)
	}
	var phantoms []string
	for id, seqs := range stream.byID {
		if !rows.sent[id] {
			phantoms = append(phantoms, fmt.Sprintf("event %d at %v", id, seqs))
		}
	}
	if len(phantoms) > 0 {
		slices.Sort(phantoms)
		rep.violate("1 (the stream holds only sent rows)", head(phantoms))
	}
}

// readOutboxRows reads every outbox row, sorts it by what became of it and
// where the stream holds it, and counts the rows in the report.
func (r *run) readOutboxRows(ctx context.Context, stream *streamContents) (*outboxRows, error) {
	rep, p := r.report, r.planted
	rows, err := r.pool().Query(ctx, `SELECT id, status, coalesce(last_error, ''), aggregate_type || '/' || aggregate_id, aggregate_seq, event_type FROM outbox ORDER BY id`)
	if err != nil {
		return nil, err
	}
	out := &outboxRows{sent: map[int64]bool{}, numbered: map[int64]aggregateEvent{}, skipped: map[int64]bool{}}
	var id int64
	var status, reason, aggregate, eventType string
	var number *int64
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &reason, &aggregate, &number, &eventType}, func() error {
		rep.OutboxRows++
		if slices.Contains(r.o.Unnumbered, eventType) {
			out.skipped[id] = true
			rep.Unnumbered++
			if number != nil {
				out.wronglyNumbered = append(out.wronglyNumbered, fmt.Sprintf("%d (%s, number %d)", id, eventType, *number))
			}
		} else if number != nil {
			out.numbered[id] = aggregateEvent{aggregate, *number}
		}
		want, isPlanted := p.failedRows[id]
		switch {
		case status == "sent" || (r.wal() && status == "pending"):
			// In wal capture the relay publishes rows it decodes and
			// leaves them pending: each must be in the stream all the
			// same.
			out.sent[id] = true
			switch n := len(stream.byID[id]); {
			case n == 0:
				out.missing = append(out.missing, strconv.FormatInt(id, 10))
			case n > 1:
				out.twice = append(out.twice, fmt.Sprintf("%d (sequences %v)", id, stream.byID[id]))
			}
		case status != "failed":
			out.notSent = append(out.notSent, fmt.Sprintf("%d (%s)", id, status))
		case reason == "":
			out.notSent = append(out.notSent, fmt.Sprintf("%d (failed without a reason)", id))
		case !isPlanted || !strings.Contains(reason, want):
			rep.FailedRows++
			out.unexpectedFailed = append(out.unexpectedFailed, fmt.Sprintf("%d (%s)", id, reason))
		default:
			rep.FailedRows++
			if len(stream.byID[id]) > 0 {
				out.failedPublished = append(out.failedPublished, strconv.FormatInt(id, 10))
			}
		}
		return nil
	})
	return out, err
}

// reportOutboxRows reports the violations readOutboxRows found.
func (r *run) reportOutboxRows(rows *outboxRows, stream *streamContents) {
	rep, p := r.report, r.planted
	if len(rows.notSent) > 0 {
		rep.violate("1 (every committed row sent or failed with a reason)", "rows "+head(rows.notSent))
	}
	if len(rows.missing) > 0 {
		rep.violate("1 (every sent row is in the stream)", fmt.Sprintf("%d sent rows missing from the stream: %s", len(rows.missing), head(rows.missing)))
	}
	if len(stream.foreign) > 0 {
		rep.violate("10 (every event carries its database's identity)", fmt.Sprintf("%d messages of another origin: %s", len(stream.foreign), head(stream.foreign)))
	}
	if len(rows.twice) > 0 {
		rep.violate("2 (every sent row is in the stream once)", fmt.Sprintf("%d events stored more than once: %s", len(rows.twice), head(rows.twice)))
	}
	if len(rows.unexpectedFailed) > 0 {
		rep.violate("5 (only planted rows failed)", "rows "+head(rows.unexpectedFailed))
	}
	if len(rows.failedPublished) > 0 {
		rep.violate("5 (a failed row is never published)", "rows "+head(rows.failedPublished))
	}
	var plantedNotFailed []string
	for id := range p.failedRows {
		if rows.sent[id] {
			plantedNotFailed = append(plantedNotFailed, strconv.FormatInt(id, 10))
		}
	}
	if len(plantedNotFailed) > 0 || rep.FailedRows < int64(len(p.failedRows)) {
		rep.violate("5 (planted rows failed)", fmt.Sprintf("%d rows failed, %d were planted to; planted but sent: %s",
			rep.FailedRows, len(p.failedRows), head(plantedNotFailed)))
	}
	if len(rows.wronglyNumbered) > 0 {
		rep.violate("8 (an event of a type the outbox does not number has no number)", "rows "+head(rows.wronglyNumbered))
	}
}

// aggregateEvent is an event's place in its aggregate.
type aggregateEvent struct {
	aggregate string
	number    int64
}

// checkAggregateOrder: invariant 8 at the stream, where the relays must
// keep it. Events of a type the outbox does not number (skipped) have no
// place to keep. Every aggregate's published events are in the stream as 1, 2,
// 3, ... (the first copy of each; a second is invariant 2's). No poison
// row shares an aggregate with another event (plant.go), so no number is
// missing. An event the stream lost and the auditor published again comes
// after later events of its aggregate: the numbers it leaves out may be
// skipped, and its own copy is not held against the order (the ordered
// subscriber's history, checked on its own, shows it applied in order).
// Only a copy lost from a sequence a rollback of the run took away is
// excused (its Fanout-Repaired-From says which: the auditor's repairs, and
// a wal relay's events decoded again after a rollback): a relay that
// skipped an event is not.
func (r *run) checkAggregateOrder(stream *streamContents, sent map[int64]bool, numbered map[int64]aggregateEvent, skipped map[int64]bool) {
	repairedNumber := map[aggregateEvent]bool{}
	for _, ev := range stream.bySeq {
		if a, ok := numbered[ev.id]; ok && r.lostToRollback(ev.repairedFrom) && len(stream.byID[ev.id]) == 1 {
			repairedNumber[a] = true
			r.report.Repaired++
		}
	}
	last := map[string]int64{}
	seen := map[int64]bool{}
	var disorder []string
	unnumbered := 0
	for _, ev := range stream.bySeq {
		if seen[ev.id] || !sent[ev.id] {
			continue
		}
		seen[ev.id] = true
		a, ok := numbered[ev.id]
		if !ok {
			if !skipped[ev.id] {
				unnumbered++
			}
			continue
		}
		if repairedNumber[a] {
			continue
		}
		next := last[a.aggregate] + 1
		for repairedNumber[aggregateEvent{a.aggregate, next}] {
			next++
		}
		if a.number != next {
			disorder = append(disorder, fmt.Sprintf("%s: event %d (number %d) at sequence %d after number %d", a.aggregate, ev.id, a.number, ev.seq, last[a.aggregate]))
		}
		last[a.aggregate] = max(last[a.aggregate], a.number)
	}
	r.report.Aggregates = len(last)
	if unnumbered > 0 {
		r.report.violate("8 (every event numbered in its aggregate)", fmt.Sprintf("%d events in the stream have no aggregate_seq", unnumbered))
	}
	if len(disorder) > 0 {
		// What the stream holds of the first aggregates out of order, copy
		// by copy, for whoever reads the report: in it, since a CI log
		// may keep only its end.
		var shown []string
		for _, d := range disorder {
			if agg := d[:strings.Index(d, ":")]; len(shown) < 2 && !slices.Contains(shown, agg) {
				shown = append(shown, agg)
			}
		}
		var held []string
		for _, agg := range shown {
			var copies []string
			for _, ev := range stream.bySeq {
				if a, ok := numbered[ev.id]; ok && a.aggregate == agg {
					copies = append(copies, fmt.Sprintf("#%d id %d seq %d repaired-from %q tx %q lost-to-rollback %v", a.number, ev.id, ev.seq, ev.repairedFrom, ev.tx, r.lostToRollback(ev.repairedFrom)))
				}
			}
			held = append(held, agg+" in the stream: "+strings.Join(copies, "; "))
		}
		r.lostMu.Lock()
		spans := slices.Clone(r.lostSpans)
		r.lostMu.Unlock()
		r.report.violate("8 (each aggregate's events enter the stream in commit order)", fmt.Sprintf("%d events out of order: %s (%s; sequences the rollbacks took away: %v)",
			len(disorder), head(disorder), strings.Join(held, "; "), spans))
	}
}

// lostToRollback says whether a repaired copy's lost sequence is one a
// rollback of the run took away.
func (r *run) lostToRollback(repairedFrom string) bool {
	seq, err := strconv.ParseUint(repairedFrom, 10, 64)
	if err != nil || seq == 0 {
		return false
	}
	r.lostMu.Lock()
	defer r.lostMu.Unlock()
	for _, span := range r.lostSpans {
		if seq >= span[0] && seq <= span[1] {
			return true
		}
	}
	return false
}

// txOf is what an event's headers say of its transaction: "" without one.
func txOf(h nats.Header) string {
	if h.Get(wire.TxHeader) == "" {
		return ""
	}
	return h.Get(wire.TxHeader) + " chunk " + h.Get(wire.TxChunkHeader) + " last " + h.Get(wire.TxLastHeader)
}

// checkTransactions: with relay.atomic transaction, every writer
// transaction of at most 1000 published events is in the stream as one
// atomic batch: the first copies of its events at consecutive sequences,
// nothing of another transaction between them, each marked as its one
// and last chunk. What makes a transaction is Postgres's word, not the
// relay's: the transaction that inserted the rows (writer_xid, which
// neither a relay nor a writer can set). A transaction an event of which the
// stream lost and the auditor published again on its own is not
// checked; nor one with an event missing (invariant 1 reports it).
func (r *run) checkTransactions(ctx context.Context, stream *streamContents) {
	rows, err := r.pool().Query(ctx, `SELECT writer_xid::text, array_agg(id ORDER BY id) FROM outbox WHERE status IN ('pending', 'sent') GROUP BY writer_xid`)
	if err != nil {
		r.report.violate("atomic (read the outbox's transactions)", err.Error())
		return
	}
	atSeq := make(map[uint64]event, len(stream.bySeq))
	for _, ev := range stream.bySeq {
		atSeq[ev.seq] = ev
	}
	var xid string
	var ids []int64
	var split []string
	_, err = pgx.ForEachRow(rows, []any{&xid, &ids}, func() error {
		seqs := make([]uint64, 0, len(ids))
		for _, id := range ids {
			copies := stream.byID[id]
			if len(copies) == 0 || r.lostToRollback(atSeq[copies[0]].repairedFrom) {
				return nil
			}
			seqs = append(seqs, copies[0])
		}
		slices.Sort(seqs)
		r.report.Transactions++
		if len(ids) > atomicChunk {
			r.report.BigTransactions++
			if problems := chunkProblems(seqs, atSeq); len(problems) > 0 {
				split = append(split, fmt.Sprintf("transaction %s (%d events, sequences %d..%d): %s", xid, len(ids), seqs[0], seqs[len(seqs)-1], strings.Join(problems, "; ")))
			}
			return nil
		}
		first, last := seqs[0], seqs[len(seqs)-1]
		tx := atSeq[first].tx
		var problems []string
		if between := int(last-first+1) - len(seqs); between > 0 {
			problems = append(problems, fmt.Sprintf("%d other messages between its events", between))
		}
		if tx == "" || !strings.HasSuffix(tx, " chunk 1 last true") {
			problems = append(problems, fmt.Sprintf("its first event marked %q, not its one and last chunk", tx))
		}
		for _, seq := range seqs {
			if atSeq[seq].tx != tx {
				problems = append(problems, fmt.Sprintf("event %d marked %q, event %d %q", atSeq[seq].id, atSeq[seq].tx, atSeq[first].id, tx))
				break
			}
		}
		if len(problems) > 0 {
			split = append(split, fmt.Sprintf("transaction %s (%d events, sequences %d..%d): %s", xid, len(ids), first, last, strings.Join(problems, "; ")))
		}
		return nil
	})
	if err != nil {
		r.report.violate("atomic (read the outbox's transactions)", err.Error())
		return
	}
	if len(split) > 0 {
		slices.Sort(split)
		r.report.violate("atomic (a transaction's events enter the stream together)", fmt.Sprintf("%d transactions not in one batch: %s", len(split), head(split)))
	}
}

// chunkProblems checks a transaction of over 1000 events, the first
// copies of its events at seqs (sorted): all marked as one transaction, in
// chunks numbered 1, 2, ... in the stream's order, each of at most 1000
// events at consecutive sequences, the last chunk, and no other, marked
// last.
func chunkProblems(seqs []uint64, atSeq map[uint64]event) []string {
	type mark struct {
		tx    string
		chunk int
		last  bool
	}
	parse := func(h string) (m mark, ok bool) {
		tx, rest, ok1 := strings.Cut(h, " chunk ")
		n, last, ok2 := strings.Cut(rest, " last ")
		k, err := strconv.Atoi(n)
		return mark{tx, k, last == "true"}, ok1 && ok2 && err == nil && tx != ""
	}
	var prev mark
	size := 0
	for i, seq := range seqs {
		ev := atSeq[seq]
		m, ok := parse(ev.tx)
		switch {
		case !ok:
			return []string{fmt.Sprintf("event %d (sequence %d) marked %q, not as a transaction's chunk", ev.id, seq, ev.tx)}
		case i == 0 && m.chunk != 1:
			return []string{fmt.Sprintf("its first event in the stream, %d, in chunk %d", ev.id, m.chunk)}
		case i == 0:
		case m.tx != prev.tx:
			return []string{fmt.Sprintf("event %d marked transaction %q, the one before it %q", ev.id, m.tx, prev.tx)}
		case m.chunk == prev.chunk && (m.last != prev.last || seq != seqs[i-1]+1):
			return []string{fmt.Sprintf("chunk %d: %d other messages between sequences %d and %d", m.chunk, seq-seqs[i-1]-1, seqs[i-1], seq)}
		case m.chunk == prev.chunk+1 && !prev.last:
			size = 0
		case m.chunk != prev.chunk:
			return []string{fmt.Sprintf("event %d (sequence %d) in chunk %d after chunk %d (marked last: %v)", ev.id, seq, m.chunk, prev.chunk, prev.last)}
		}
		if size++; size > atomicChunk {
			return []string{fmt.Sprintf("chunk %d holds over %d events", m.chunk, atomicChunk)}
		}
		prev = m
	}
	if !prev.last {
		return []string{fmt.Sprintf("its last chunk, %d, not marked last", prev.chunk)}
	}
	return nil
}

// atomicChunk is the most events a transaction's chunk holds (NATS's
// atomic batch limit).
const atomicChunk = 1000

// seqOf returns the last stream sequence holding the event of this run's
// database with that id.
func (c *streamContents) seqOf(id int64) (uint64, bool) {
	seqs := c.byID[id]
	if len(seqs) == 0 {
		return 0, false
	}
	return slices.Max(seqs), true
}
