package subscribers

// Ordered subscribers: each aggregate's events one at a time, in their
// aggregate's order, while different aggregates run concurrently. The
// choices are explained in the package doc ("Ordered subscribers").

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// orderedGroup is the priority group an ordered subscriber's instances
// pull in: the consumer pins it to one instance at a time.
const orderedGroup = "fanout"

// DeadHeldByHeader is set on the dead letter of an event held behind an
// earlier dead-lettered event of its aggregate: the id of that event.
const DeadHeldByHeader = "Fanout-Dead-Held-By"

// orderInfo is what the ordered dispatcher tells the handler's transaction
// about one event.
type orderInfo struct {
	// prev is the aggregate number the checkpoint must be at for the
	// event to be applied: its number - 1, or, after a gap given up on,
	// the last number applied.
	prev     int64
	afterGap bool
	// lateOK: an operator's redrive may apply an event its aggregate moved
	// past (a dead letter let pass under on_dead_letter=skip); the
	// checkpoint stays where it is.
	lateOK bool
}

// aggregateKey names an aggregate.
type aggregateKey struct{ typ, id string }

func keyOf(h nats.Header) aggregateKey {
	return aggregateKey{h.Get(outbox.AggregateTypeHeader), h.Get(outbox.AggregateIDHeader)}
}

// The statements on subscriber_aggregates, the per-aggregate checkpoint.
const (
	// advanceSQL moves each aggregate's checkpoint to its event's number,
	// where it is at the number expected (prev) and not held behind
	// another event. The event holding an aggregate releases it (a redrive).
	advanceSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, last_event_id)
SELECT $1, t, i, s, p, e FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::bigint[]) AS w(t, i, s, p, e)
ON CONFLICT (subscriber, aggregate_type, aggregate_id) DO UPDATE
SET last_seq = excluded.last_seq, prev_seq = excluded.prev_seq, last_event_id = excluded.last_event_id,
    held_by_event = NULL, held_seq = NULL, updated_at = now()
WHERE a.last_seq = excluded.prev_seq AND (a.held_by_event IS NULL OR a.held_by_event = excluded.last_event_id)
RETURNING last_event_id`

	// aggregatesSQL reads the checkpoints of some aggregates (no row: none
	// of its events applied yet).
	aggregatesSQL = `
SELECT w.t, w.i, a.last_seq, a.held_by_event, a.held_seq
FROM unnest($2::text[], $3::text[]) AS w(t, i)
LEFT JOIN subscriber_aggregates a ON a.subscriber = $1 AND a.aggregate_type = w.t AND a.aggregate_id = w.i`

	// holdSQL holds an aggregate behind its dead-lettered event (unless it
	// is held already, or moved past the event).
	holdSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, held_by_event, held_seq)
VALUES ($1, $2, $3, $4::bigint - 1, $4::bigint - 1, $5::bigint, $4::bigint)
ON CONFLICT (subscriber, aggregate_type, aggregate_id) DO UPDATE
SET held_by_event = excluded.held_by_event, held_seq = excluded.held_seq, updated_at = now()
WHERE a.held_by_event IS NULL AND a.last_seq < excluded.held_seq`

	// passSQL lets an aggregate move past its dead-lettered event.
	passSQL = `
INSERT INTO subscriber_aggregates AS a (subscriber, aggregate_type, aggregate_id, last_seq, prev_seq, last_event_id)
VALUES ($1, $2, $3, $4::bigint, $4::bigint - 1, $5::bigint)
ON CONFLICT (subscriber, aggregate_type, aggregate_id) DO UPDATE
SET last_seq = excluded.last_seq, prev_seq = a.last_seq, last_event_id = excluded.last_event_id, updated_at = now()
WHERE a.held_by_event IS NULL AND a.last_seq < excluded.last_seq`

	releaseSQL = `
UPDATE subscriber_aggregates
SET last_seq = held_seq, prev_seq = last_seq, last_event_id = held_by_event, held_by_event = NULL, held_seq = NULL, updated_at = now()
WHERE subscriber = $1 AND held_by_event = $2`

	countHeldSQL = `SELECT subscriber, count(*) FROM subscriber_aggregates WHERE held_by_event IS NOT NULL GROUP BY subscriber`
)

// CountHeldAggregates returns, per ordered subscriber, how many aggregates
// are held behind a dead-lettered event.
func CountHeldAggregates(ctx context.Context, pool *pgxpool.Pool) (map[string]int64, error) {
	counts, err := countBySubscriber(ctx, pool, countHeldSQL)
	if err != nil {
		return nil, fmt.Errorf("count held aggregates: %w", err)
	}
	return counts, nil
}

// Release lets an ordered subscriber's aggregate held behind event (its
// dead letter discarded by an operator) move past it: the events held
// behind it can then be redriven, in order, and its later events flow
// again. It reports whether event held an aggregate.
func Release(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, subscriber string, event int64) (bool, error) {
	ct, err := q.Exec(ctx, releaseSQL, subscriber, event)
	if err != nil {
		return false, fmt.Errorf("release the aggregate held behind event %d: %w", event, err)
	}
	return ct.RowsAffected() > 0, nil
}

// errOutOfTurn: the checkpoint of the event's aggregate is not where the
// dispatcher thought (another instance moved it, or an earlier event is
// still missing). Not the event's fault: it is tried again.
var errOutOfTurn = errors.New("not its aggregate's next event")

// heldError: the event's aggregate is held behind a dead-lettered event.
type heldError struct {
	by, bySeq int64
	seq       int64
}

func (e *heldError) Error() string {
	return fmt.Sprintf("held behind event %d (number %d of its aggregate), which went to the dead letters before it "+
		"(subscribers.on_dead_letter=hold): redrive event %d first, then this one (number %d)", e.by, e.bySeq, e.by, e.seq)
}

// advance moves the per-aggregate checkpoints of the fresh, numbered
// events in ds, in the handler's transaction. An event that may not be
// applied now is an error: held or late (the dead letters), or out of
// turn (tried again).
func (r *Runner) advance(ctx context.Context, tx pgx.Tx, ds []*delivery, fresh map[int64]bool) error {
	var types, ids []string
	var seqs, prevs, events []int64
	late := map[int64]bool{}
	for _, d := range ds {
		if !fresh[d.ev.ID] || d.ev.AggregateSeq == 0 {
			continue
		}
		types, ids = append(types, d.ev.AggregateType), append(ids, d.ev.AggregateID)
		prev := d.order.prev
		if !d.order.afterGap {
			prev = d.ev.AggregateSeq - 1
		}
		seqs, prevs, events = append(seqs, d.ev.AggregateSeq), append(prevs, prev), append(events, d.ev.ID)
		late[d.ev.ID] = d.order.lateOK
	}
	if len(events) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, advanceSQL, r.name, types, ids, seqs, prevs, events)
	if err != nil {
		return fmt.Errorf("advance the aggregates' checkpoints: %w", err)
	}
	advanced, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("advance the aggregates' checkpoints: %w", err)
	}
	if len(advanced) == len(events) {
		return nil
	}
	// Why not: read the checkpoints of the aggregates left behind.
	done := map[int64]bool{}
	for _, id := range advanced {
		done[id] = true
	}
	var lt, li []string
	var lseq, lev []int64
	for i, id := range events {
		if !done[id] {
			lt, li, lseq, lev = append(lt, types[i]), append(li, ids[i]), append(lseq, seqs[i]), append(lev, id)
		}
	}
	states, err := r.aggregateStates(ctx, tx, lt, li)
	if err != nil {
		return err
	}
	for i, id := range lev {
		st := states[aggregateKey{lt[i], li[i]}]
		switch {
		case st.heldBy != 0 && st.heldBy != id:
			return &eventError{id: id, err: Permanent(&heldError{by: st.heldBy, bySeq: st.heldSeq, seq: lseq[i]})}
		case st.last >= lseq[i] && late[id]:
			// An operator's redrive of an event its aggregate moved past:
			// applied, the checkpoint left as it is.
		case st.last >= lseq[i]:
			return &eventError{id: id, err: Permanent(fmt.Errorf(
				"arrived after its aggregate %s/%s moved past it: this is number %d, and number %d is applied "+
					"(it was let pass: a gap given up on after subscribers.gap_wait, or a dead letter under on_dead_letter=skip)",
				lt[i], li[i], lseq[i], st.last))}
		default:
			return &eventError{id: id, err: fmt.Errorf("event %d (number %d of %s/%s): %w: the checkpoint is at number %d",
				id, lseq[i], lt[i], li[i], errOutOfTurn, st.last)}
		}
	}
	return nil
}

// aggregateState is one aggregate's checkpoint as read.
type aggregateState struct {
	exists          bool
	last            int64
	heldBy, heldSeq int64
}

func (r *Runner) aggregateStates(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, types, ids []string) (map[aggregateKey]aggregateState, error) {
	rows, err := q.Query(ctx, aggregatesSQL, r.name, types, ids)
	if err != nil {
		return nil, fmt.Errorf("read the aggregates' checkpoints: %w", err)
	}
	out := make(map[aggregateKey]aggregateState, len(types))
	var k aggregateKey
	var last, heldBy, heldSeq *int64
	_, err = pgx.ForEachRow(rows, []any{&k.typ, &k.id, &last, &heldBy, &heldSeq}, func() error {
		st := aggregateState{exists: last != nil}
		if last != nil {
			st.last = *last
		}
		if heldBy != nil {
			st.heldBy = *heldBy
		}
		if heldSeq != nil {
			st.heldSeq = *heldSeq
		}
		out[k] = st
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the aggregates' checkpoints: %w", err)
	}
	return out, nil
}

// afterDeadLetter records what a dead-lettered event of an ordered
// subscriber does to its aggregate: holds it (on_dead_letter=hold) or lets
// it pass (skip). An event held behind another changes nothing.
func (r *Runner) afterDeadLetter(ctx context.Context, d *delivery) error {
	if !r.ordered || d.ev.AggregateSeq == 0 || d.heldBy != 0 {
		return nil
	}
	ctx, cancel := r.bookkeeping(ctx)
	defer cancel()
	sql := holdSQL
	if r.cfg.OnDeadLetter == "skip" {
		sql = passSQL
	}
	_, err := r.opts.Pool.Exec(ctx, sql, r.name, d.ev.AggregateType, d.ev.AggregateID, d.ev.AggregateSeq, d.ev.ID)
	if err != nil {
		return fmt.Errorf("record the dead letter in its aggregate's checkpoint: %w", err)
	}
	return nil
}

// The ordered dispatcher -----------------------------------------------------

// waitingMsg is a received message waiting for its aggregate's turn.
type waitingMsg struct {
	msg jetstream.Msg
	seq int64 // 0: an event without a number, taken in arrival order
}

// aggregateLine is one aggregate's received events and what is known of
// its checkpoint.
type aggregateLine struct {
	key     aggregateKey
	waiting []waitingMsg // by number; events without one in arrival order
	// sent is the message in a batch (formed, or with a worker: taken),
	// or nil.
	sent    jetstream.Msg
	taken   bool
	queued  bool // in the ready list, or in the batch being formed
	loaded  bool // lastSeq and held are read from the checkpoint
	loading bool
	lastSeq int64
	held    bool
	// gapSince: the first waiting event has been waiting since then for an
	// earlier one (in the future while an event sent back waits for its
	// redelivery). The checkpoint is read again when the gap is seen
	// (gapLoaded) and after gap_wait (gapChecked), in case another
	// instance moved it.
	gapSince              time.Time
	gapLoaded, gapChecked bool
}

func (l *aggregateLine) insert(w waitingMsg) {
	i := len(l.waiting)
	if w.seq > 0 {
		for i > 0 && l.waiting[i-1].seq > w.seq {
			i--
		}
	}
	l.waiting = slices.Insert(l.waiting, i, w)
}

func (l *aggregateLine) remove(m jetstream.Msg) {
	l.waiting = slices.DeleteFunc(l.waiting, func(w waitingMsg) bool { return w.msg == m })
}

// orderedDispatch is the dispatcher's state: one goroutine owns it.
type orderedDispatch struct {
	r        *Runner
	lines    map[aggregateKey]*aggregateLine
	ready    []*aggregateLine
	toLoad   []*aggregateLine
	loadWait time.Time // after a failed load, not before
	forming  *received // a batch formed and not yet taken by a worker
	inFlight int       // batches with the workers
}

// maxIdleLines bounds the aggregates whose checkpoint the dispatcher
// remembers while none of their events waits.
const maxIdleLines = 100_000

// dispatchOrdered is dispatch for an ordered subscriber: it holds each
// aggregate's events in number order and gives the workers batches of at
// most one event per aggregate, the next one of each, and the next only
// when the one before it is done. finished returns each batch's
// deliveries when its worker is done with them.
func (r *Runner) dispatchOrdered(hardCtx context.Context, batches chan<- received, finished <-chan []*delivery) {
	defer close(batches)
	incoming := make(chan []jetstream.Msg)
	reading := make(chan struct{})
	go func() {
		defer close(reading)
		r.readOrdered(hardCtx, incoming)
	}()
	defer func() { <-reading }()
	od := &orderedDispatch{r: r, lines: map[aggregateKey]*aggregateLine{}}
	keepAlive := time.NewTicker(r.cfg.AckWait / 3)
	defer keepAlive.Stop()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		if incoming == nil && od.inFlight == 0 {
			// Stopping, and every worker is done: the events still held go
			// back to the consumer at once, for the instance pinned next.
			od.release()
			return
		}
		od.load(hardCtx)
		var out chan<- received
		var next received
		if incoming != nil && od.formBatch() {
			out, next = batches, *od.forming
		}
		select {
		case out <- next:
			for _, m := range next.msgs {
				od.lines[keyOf(m.Headers())].taken = true
			}
			od.forming = nil
			od.inFlight++
		case ms, ok := <-incoming:
			if !ok {
				incoming = nil
				od.unform()
				continue
			}
			for _, m := range ms {
				od.add(m)
			}
		case ds := <-finished:
			od.inFlight--
			od.finish(ds)
		case <-keepAlive.C:
			od.keepAlive()
		case <-tick.C:
			od.checkGaps()
		case <-hardCtx.Done():
			return
		}
	}
}

// readOrdered forwards received messages to the dispatcher, a few at a
// time (what arrives within gatherWait: their aggregates' checkpoints are
// then read in one query), until the iterator is drained or stopped. It
// reads on through an outage (the workers hold their events then): an
// instance that stopped reading would stop pulling, and lose its pin to
// another instance after subscribers.pinned_ttl while still holding
// events.
func (r *Runner) readOrdered(hardCtx context.Context, out chan<- []jetstream.Msg) {
	defer close(out)
	for {
		msgs, closed := r.receive(hardCtx)
		if len(msgs) > 0 {
			select {
			case out <- msgs:
			case <-hardCtx.Done():
				return
			}
		}
		if closed {
			return
		}
	}
}

func (od *orderedDispatch) add(m jetstream.Msg) {
	h := m.Headers()
	k := keyOf(h)
	l := od.lines[k]
	if l == nil {
		l = &aggregateLine{key: k}
		od.lines[k] = l
	}
	var seq int64
	if ev, err := EventFromParts(nil, h, m.Subject(), od.r.opts.Stream.SubjectPrefix); err == nil {
		seq = ev.AggregateSeq
	}
	l.insert(waitingMsg{msg: m, seq: seq})
	od.evaluate(l)
}

// evaluate puts the line in the ready list if its first waiting event may
// go to a worker now.
func (od *orderedDispatch) evaluate(l *aggregateLine) {
	if l.sent != nil || l.queued || len(l.waiting) == 0 {
		return
	}
	if !l.loaded {
		od.reload(l)
		return
	}
	head := l.waiting[0]
	if head.seq == 0 || l.held || head.seq <= l.lastSeq+1 {
		l.gapSince, l.gapLoaded, l.gapChecked = time.Time{}, false, false
		l.queued = true
		od.ready = append(od.ready, l)
		return
	}
	// A gap: an earlier event of the aggregate has not arrived.
	if l.gapSince.IsZero() {
		l.gapSince = time.Now()
		od.r.logger.Debug("an aggregate's event waits for an earlier one", "aggregate_type", l.key.typ, "aggregate_id", l.key.id,
			"number", head.seq, "applied", l.lastSeq)
	}
	if !l.gapLoaded {
		l.gapLoaded = true
		od.reload(l)
		return
	}
	if time.Since(l.gapSince) < od.r.cfg.gapWait() {
		return
	}
	if !l.gapChecked {
		l.gapChecked = true
		od.reload(l)
		return
	}
	od.r.logger.Warn("giving up on an aggregate's missing events: applying the next one that arrived (marked AfterGap)",
		"aggregate_type", l.key.typ, "aggregate_id", l.key.id, "number", head.seq, "applied", l.lastSeq,
		"waited", time.Since(l.gapSince).Round(time.Second), "gap_wait", od.r.cfg.gapWait())
	l.queued = true
	od.ready = append(od.ready, l)
}

// reload reads the line's checkpoint again before its next event goes.
func (od *orderedDispatch) reload(l *aggregateLine) {
	l.loaded = false
	if !l.loading {
		l.loading = true
		od.toLoad = append(od.toLoad, l)
	}
}

// checkGaps looks again at the lines waiting for an earlier event, and
// forgets idle aggregates when too many are remembered.
func (od *orderedDispatch) checkGaps() {
	for _, l := range od.lines {
		if !l.gapSince.IsZero() && l.sent == nil && !l.queued && l.loaded {
			od.evaluate(l)
		}
	}
	if len(od.lines) > maxIdleLines {
		for k, l := range od.lines {
			if len(l.waiting) == 0 && l.sent == nil && !l.loading {
				delete(od.lines, k)
			}
		}
	}
}

// load reads the checkpoints of the lines that need them, in one query.
func (od *orderedDispatch) load(ctx context.Context) {
	if len(od.toLoad) == 0 || time.Now().Before(od.loadWait) {
		return
	}
	lines := od.toLoad
	od.toLoad = nil
	types, ids := make([]string, len(lines)), make([]string, len(lines))
	for i, l := range lines {
		types[i], ids[i] = l.key.typ, l.key.id
	}
	qctx, cancel := od.r.bookkeeping(ctx)
	states, err := od.r.aggregateStates(qctx, od.r.opts.Pool, types, ids)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			od.r.health.markDown(DependencyPostgres, err)
			od.loadWait = time.Now().Add(time.Second)
		}
		od.toLoad = append(lines, od.toLoad...)
		return
	}
	for _, l := range lines {
		st := states[l.key]
		l.loading, l.loaded = false, true
		l.lastSeq, l.held = st.last, st.heldBy != 0
		if !st.exists && od.r.cfg.Start != "all" && len(l.waiting) > 0 && l.waiting[0].seq > 0 {
			// The consumer began after the stream's start: the aggregate's
			// history begins, for this subscriber, with its first event.
			l.lastSeq = l.waiting[0].seq - 1
		}
		od.evaluate(l)
	}
}

// formBatch takes ready lines into the batch being formed: their first
// waiting events, one per aggregate. A held aggregate's event goes alone
// (its transaction sends it to the dead letters). It reports whether there
// is a batch.
func (od *orderedDispatch) formBatch() bool {
	if od.forming != nil {
		return true
	}
	if len(od.ready) == 0 {
		return false
	}
	b := &received{at: time.Now()}
	n := 0
	for n < len(od.ready) && len(b.msgs) < od.r.cfg.BatchSize {
		l := od.ready[n]
		if l.held && len(b.msgs) > 0 {
			break
		}
		n++
		head := l.waiting[0]
		info := orderInfo{prev: head.seq - 1}
		if head.seq > l.lastSeq+1 && !l.held {
			info = orderInfo{prev: l.lastSeq, afterGap: true}
		}
		l.sent = head.msg
		b.msgs = append(b.msgs, head.msg)
		b.order = append(b.order, info)
		if l.held {
			break
		}
	}
	od.ready = slices.Delete(od.ready, 0, n)
	od.forming = b
	return true
}

// unform returns a formed batch that no worker took (stopping).
func (od *orderedDispatch) unform() {
	if od.forming == nil {
		return
	}
	for _, m := range od.forming.msgs {
		if l := od.lines[keyOf(m.Headers())]; l != nil {
			l.sent, l.queued = nil, false
		}
	}
	od.forming = nil
}

// finish learns what became of a batch's events and lets each aggregate's
// next one go.
func (od *orderedDispatch) finish(ds []*delivery) {
	for _, d := range ds {
		l := od.lines[keyOf(d.msg.Headers())]
		if l == nil || l.sent != d.msg {
			continue
		}
		l.remove(d.msg)
		l.sent, l.taken, l.queued = nil, false, false
		switch d.fate.Load() {
		case fateAcked:
			l.lastSeq = max(l.lastSeq, d.ev.AggregateSeq)
		case fateNaked:
			// Sent back to be tried again: its aggregate waits for its
			// redelivery, and counts no gap before it is due.
			l.gapSince, l.gapLoaded, l.gapChecked = time.Now().Add(d.nakDelay), true, false
			od.reload(l)
		default:
			// Dead-lettered (held or let pass), or abandoned at a stop:
			// read the checkpoint again before the aggregate's next event.
			od.reload(l)
		}
		od.evaluate(l)
	}
}

// keepAlive tells JetStream the held events are still wanted, so that
// they are not redelivered (to this instance, out of turn) meanwhile. A
// worker keeps its own batch alive.
func (od *orderedDispatch) keepAlive() {
	for _, l := range od.lines {
		for _, w := range l.waiting {
			if w.msg != l.sent || !l.taken {
				_ = w.msg.InProgress()
			}
		}
	}
}

// release gives the held events back to the consumer (stopping).
func (od *orderedDispatch) release() {
	od.unform()
	n := 0
	for _, l := range od.lines {
		for _, w := range l.waiting {
			if w.msg != l.sent || !l.taken {
				_ = w.msg.Nak()
				n++
			}
		}
	}
	if n > 0 {
		od.r.logger.Info("stopping: gave back the events waiting for their aggregate's turn", "events", n)
	}
}
