package subscribers

// From the consumer to the workers: batches of deliveries, kept alive
// while they are worked on.

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// gatherWait is how long the dispatcher waits for more messages to fill a
// batch once it has one: short, so a lone event is not held back.
const gatherWait = 2 * time.Millisecond

// dispatch groups received messages into batches for the workers, until
// the iterator is drained or stopped. While a dependency is down it pulls
// nothing: the events in hand wait for it, and new ones would only wait too.
func (r *Runner) dispatch(softCtx, hardCtx context.Context, batches chan<- received) {
	defer close(batches)
	for {
		if !r.health.WaitUp(softCtx) {
			return
		}
		msgs, closed := r.receive(hardCtx)
		if len(msgs) > 0 {
			select {
			case batches <- received{msgs: msgs, at: time.Now()}:
			case <-hardCtx.Done():
				return
			}
		}
		if closed {
			return
		}
	}
}

// receive waits for a message, then takes the ones that arrive within
// gatherWait, up to a batch. closed: the iterator is drained or stopped
// (or ctx ended), and nothing more will come.
func (r *Runner) receive(ctx context.Context) (msgs []jetstream.Msg, closed bool) {
	msg, err := r.feed.next(jetstream.NextContext(ctx))
	if err != nil {
		if errors.Is(err, jetstream.ErrMsgIteratorClosed) || ctx.Err() != nil {
			return nil, true
		}
		r.logger.Warn("receive", "error", err)
		return nil, false
	}
	msgs = []jetstream.Msg{msg}
	for len(msgs) < r.cfg.BatchSize {
		m, err := r.feed.next(jetstream.NextMaxWait(gatherWait))
		if err != nil {
			return msgs, errors.Is(err, jetstream.ErrMsgIteratorClosed)
		}
		msgs = append(msgs, m)
	}
	return msgs, false
}

// received is a batch of messages as the dispatcher took them from the
// consumer, and when (the first arrived then; the others were waiting in the
// client's buffer or came within gatherWait).
type received struct {
	msgs []jetstream.Msg
	at   time.Time
	// order is, for an ordered subscriber, what its dispatcher says of
	// each message (parallel to msgs).
	order []orderInfo
}

// delivery is one received message and the event it carries, with what the
// runtime has learned about it so far.
type delivery struct {
	msg         jetstream.Msg
	ev          Event
	deliveredAt time.Time
	// deadReason, once set, is the event's fate: the dead letters. It is
	// kept while the dead-letter stream is unavailable, so the handler does
	// not run again meanwhile.
	deadReason string
	// opened: an attempt is open in subscriber_attempts for this delivery.
	opened bool
	// hasRow: subscriber_attempts may hold a row for the event.
	hasRow bool
	// mark: a redelivery, whose attempts are recorded (opened before the
	// handler runs, closed with the outcome).
	mark bool
	// dups are other deliveries of the same event in the batch (the event
	// stored twice in the stream, or one message delivered twice into the
	// pull buffer): they share this delivery's fate.
	dups    []*delivery
	settled atomic.Bool // acked, naked or termed
	// fate is which of those (fateAcked, ...), for the ordered dispatcher;
	// nakDelay the delay of a nak.
	fate     atomic.Int32
	nakDelay time.Duration
	// order is the ordered dispatcher's word on the event; heldBy, the
	// dead-lettered event its aggregate is held behind.
	order  orderInfo
	heldBy int64
}

// A delivery's fate.
const (
	fateNone   int32 = iota // not settled: abandoned at a stop, or held
	fateAcked               // handled (or a duplicate): acked
	fateNaked               // sent back to be tried again
	fateTermed              // dead-lettered
)

// msgs are the delivery's message and its duplicates'.
func (d *delivery) msgs() []jetstream.Msg {
	out := make([]jetstream.Msg, 0, 1+len(d.dups))
	out = append(out, d.msg)
	for _, dup := range d.dups {
		out = append(out, dup.msg)
	}
	return out
}

// process takes a batch from delivery to its outcome. Events held by an
// outage stay in hand (kept alive with in-progress signals) and are tried
// again when every dependency answers; their deliveries cost them nothing.
func (r *Runner) process(softCtx, hardCtx context.Context, batch received) (all []*delivery) {
	ds := make([]*delivery, 0, len(batch.msgs))
	type identity struct {
		origin string
		id     int64
	}
	first := make(map[identity]*delivery, len(batch.msgs))
	for i, m := range batch.msgs {
		ev, err := EventFromMsg(m, r.opts.Stream.SubjectPrefix)
		d := &delivery{msg: m, ev: ev, deliveredAt: batch.at}
		if i < len(batch.order) {
			d.order = batch.order[i]
			d.ev.AfterGap = d.order.afterGap
		}
		if err != nil {
			d.deadReason = err.Error()
		} else if p := first[identity{ev.Origin, ev.ID}]; p != nil {
			// One attempt for the event; the copy shares its fate (a copy
			// acked as a duplicate while the first failed would lose the
			// event, if both are the same stream message).
			p.dups = append(p.dups, d)
			continue
		} else {
			first[identity{ev.Origin, ev.ID}] = d
		}
		ds = append(ds, d)
	}
	all = ds
	stop := r.keepAlive(ds)
	defer stop()
	for len(ds) > 0 {
		if !r.health.WaitUp(softCtx) {
			// Stopping during an outage: let the events go; another
			// instance (or the next start) gets them after the ack wait.
			r.attempts.close(ds)
			return all
		}
		if err := r.origins.keyEvents(hardCtx, ds); err != nil {
			r.health.MarkDown(DependencyPostgres, err)
			continue
		}
		ds = r.attempt(hardCtx, ds)
	}
	return all
}

// keepAlive tells JetStream the batch is still being worked on (or held
// for an outage), so it is not redelivered to another instance meanwhile.
func (r *Runner) keepAlive(ds []*delivery) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(r.cfg.AckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				for _, d := range ds {
					if !d.settled.Load() {
						for _, m := range d.msgs() {
							_ = m.InProgress()
						}
					}
				}
			}
		}
	})
	return func() {
		close(done)
		wg.Wait()
	}
}

// EventFromMsg reads the event a relayed message carries; subjectPrefix is
// the stream's (stream.subject_prefix). Its error says why a message is not
// an outbox event; the Event is filled as far as it could be.
func EventFromMsg(m jetstream.Msg, subjectPrefix string) (Event, error) {
	ev, err := EventFromParts(m.Data(), m.Headers(), m.Subject(), subjectPrefix)
	if md, merr := m.Metadata(); merr == nil {
		ev.StreamSeq, ev.Delivery, ev.StoredAt = md.Sequence.Stream, md.NumDelivered, md.Timestamp
	}
	return ev, err
}

// EventFromParts reads an event from a message's body, headers and subject
// (for messages read from a stream directly, such as dead letters), by
// the wire format's rules (wire.Decode).
func EventFromParts(data []byte, h nats.Header, subject, subjectPrefix string) (Event, error) {
	w, err := wire.Decode(data, h, subject, subjectPrefix)
	return Event{ID: w.ID, Origin: w.Origin, Type: w.Type, AggregateType: w.AggregateType, AggregateID: w.AggregateID,
		AggregateSeq: w.AggregateSeq, CreatedAt: w.CreatedAt, Payload: w.Payload, Headers: w.Headers, Subject: w.Subject}, err
}
