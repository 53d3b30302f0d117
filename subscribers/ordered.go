package subscribers

// Ordered subscribers: each aggregate's events one at a time, in their
// aggregate's order, while different aggregates run concurrently. The
// choices are explained in the package doc ("Ordered subscribers"). This
// file is the dispatcher, which hands the workers each aggregate's next
// event; orderedturn.go decides when that event may go (the checkpoint as
// read, a gap waited for), and orderedcheckpoint.go is the per-aggregate
// checkpoint in Postgres that the handler's transaction moves.

import (
	"context"
	"slices"
	"time"

	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// orderedGroup is the priority group an ordered subscriber's instances
// pull in: the consumer pins it to one instance at a time.
const orderedGroup = "fanout"

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

// aggregateKey names an aggregate: its database ("" for the subscriber's
// own, see originKeys.database), type and id.
type aggregateKey = bookkeeping.AggregateKey

func (od *orderedDispatch) keyOf(h nats.Header) aggregateKey {
	return aggregateKey{DB: od.r.origins.database(h.Get(wire.OriginHeader)), Type: h.Get(wire.AggregateTypeHeader), ID: h.Get(wire.AggregateIDHeader)}
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

// dispatchOrdered is dispatch for an ordered subscriber: it holds each
// aggregate's events in number order and gives the workers batches of at
// most one event per aggregate, the next one of each, and the next only
// when the one before it is done. finished returns each batch's
// deliveries when its worker is done with them.
func dispatchOrdered(r *Runner, hardCtx context.Context, batches chan<- received, finished <-chan []*delivery) {
	od := &orderedDispatch{r: r, lines: map[aggregateKey]*aggregateLine{}}
	od.run(hardCtx, batches, finished)
}

func (od *orderedDispatch) run(hardCtx context.Context, batches chan<- received, finished <-chan []*delivery) {
	defer close(batches)
	incoming := make(chan []jetstream.Msg)
	reading := make(chan struct{})
	go func() {
		defer close(reading)
		od.read(hardCtx, incoming)
	}()
	defer func() { <-reading }()
	keepAlive := time.NewTicker(od.r.cfg.AckWait / 3)
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
				od.lines[od.keyOf(m.Headers())].taken = true
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

// read forwards received messages to the dispatcher, a few at a
// time (what arrives within gatherWait: their aggregates' checkpoints are
// then read in one query), until the iterator is drained or stopped. It
// reads on through an outage (the workers hold their events then): an
// instance that stopped reading would stop pulling, and lose its pin to
// another instance after subscribers.pinned_ttl while still holding
// events.
func (od *orderedDispatch) read(hardCtx context.Context, out chan<- []jetstream.Msg) {
	defer close(out)
	for {
		msgs, closed := od.r.receive(hardCtx)
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
	k := od.keyOf(h)
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
		switch {
		case l.held:
		case head.seq > l.lastSeq+1:
			info = orderInfo{prev: l.lastSeq, afterGap: true}
		case l.firstSeen:
			info = orderInfo{prev: head.seq - 1, afterGap: true}
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
		if l := od.lines[od.keyOf(m.Headers())]; l != nil {
			l.sent, l.queued = nil, false
		}
	}
	od.forming = nil
}

// finish learns what became of a batch's events and lets each aggregate's
// next one go.
func (od *orderedDispatch) finish(ds []*delivery) {
	for _, d := range ds {
		l := od.lines[od.keyOf(d.msg.Headers())]
		if l == nil || l.sent != d.msg {
			continue
		}
		l.remove(d.msg)
		l.sent, l.taken, l.queued = nil, false, false
		switch d.fate.Load() {
		case fateAcked:
			l.lastSeq, l.firstSeen = max(l.lastSeq, d.ev.AggregateSeq), false
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
