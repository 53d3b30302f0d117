package subscribers

// The per-aggregate checkpoint of the ordered subscribers,
// subscriber_aggregates: the number of the last event applied, moved from
// n-1 to n in the handler's transaction; what becomes of an event that may
// not be applied now (held behind a dead letter, late, or out of turn); and
// what a dead letter does to its aggregate (holds it, or lets it pass).

import (
	"context"
	"errors"
	"fmt"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
)

// DeadHeldByHeader is set on the dead letter of an event held behind an
// earlier dead-lettered event of its aggregate: the id of that event.
const DeadHeldByHeader = "Fanout-Dead-Held-By"

// aggregates is an ordered subscriber's per-aggregate checkpoint.
type aggregates struct {
	name    string
	store   bookkeeping.Store
	origins *originKeys
	cfg     Config // on_dead_letter, and handler_timeout (see bounded)
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
func (a *aggregates) advance(ctx context.Context, tx pgx.Tx, ds []*delivery, fresh map[int64]bool) error {
	p := bookkeeping.AggregateAdvanceParams{Subscriber: a.name}
	late := map[int64]bool{}
	epochs := map[int64]int{}
	idOf := map[int64]int64{} // checkpoint key -> event id, for the messages
	for _, d := range ds {
		if !fresh[d.ev.key()] || d.ev.AggregateSeq == 0 {
			continue
		}
		prev := d.order.prev
		if !d.order.afterGap {
			prev = d.ev.AggregateSeq - 1
		}
		// Events are known by their checkpoint keys here, in the table
		// too (last_event_id, held_by_event): two databases' event 42 are
		// two events.
		key := d.ev.key()
		p.Keys = append(p.Keys, a.keyOf(d.ev))
		p.Seqs, p.Prevs, p.Events = append(p.Seqs, d.ev.AggregateSeq), append(p.Prevs, prev), append(p.Events, key)
		p.AfterGap = append(p.AfterGap, d.order.afterGap)
		late[key] = d.order.lateOK
		idOf[key] = d.ev.ID
		if o, err := outbox.ParseOrigin(d.ev.Origin); err == nil {
			epochs[key] = o.Epoch
		}
	}
	if len(p.Events) == 0 {
		return nil
	}
	store := bookkeeping.New(tx)
	advanced, err := store.AggregateAdvance(ctx, p)
	if err != nil {
		return fmt.Errorf("advance the aggregates' checkpoints: %w", err)
	}
	if len(advanced) == len(p.Events) {
		return nil
	}
	// Why not: read the checkpoints of the aggregates left behind.
	done := map[int64]bool{}
	for _, id := range advanced {
		done[id] = true
	}
	var left []aggregateKey
	var lseq, lev []int64
	for i, id := range p.Events {
		if !done[id] {
			left, lseq, lev = append(left, p.Keys[i]), append(lseq, p.Seqs[i]), append(lev, id)
		}
	}
	states, err := a.states(ctx, store, left)
	if err != nil {
		return err
	}
	for i, id := range lev {
		k := left[i]
		st := states[k]
		switch {
		case st.HeldBy != 0 && st.HeldBy != id:
			return &eventError{id: idOf[id], err: Permanent(&heldError{by: st.HeldBy, bySeq: st.HeldSeq, seq: lseq[i]})}
		case st.Last >= lseq[i] && late[id]:
			// An operator's redrive of an event its aggregate moved past:
			// applied, the checkpoint left as it is.
		case st.Last >= lseq[i] && epochs[id] > 1:
			return &eventError{id: idOf[id], err: Permanent(fmt.Errorf(
				"arrived after its aggregate %s/%s moved past it: this is number %d, and number %d is applied; "+
					"the event is of outbox epoch %d: its database was restored from a backup, and the events it lost had used the numbers "+
					"its new events are given again (redrive this one to apply it)",
				k.Type, k.ID, lseq[i], st.Last, epochs[id]))}
		case st.Last >= lseq[i]:
			return &eventError{id: idOf[id], err: Permanent(fmt.Errorf(
				"arrived after its aggregate %s/%s moved past it: this is number %d, and number %d is applied "+
					"(it was let pass: a gap given up on after subscribers.gap_wait, or a dead letter under on_dead_letter=skip)",
				k.Type, k.ID, lseq[i], st.Last))}
		default:
			return &eventError{id: idOf[id], err: fmt.Errorf("event %d (number %d of %s/%s): %w: the checkpoint is at number %d",
				idOf[id], lseq[i], k.Type, k.ID, errOutOfTurn, st.Last)}
		}
	}
	return nil
}

// keyOf is the aggregate of ev.
func (a *aggregates) keyOf(ev Event) aggregateKey {
	return aggregateKey{DB: a.origins.database(ev.Origin), Type: ev.AggregateType, ID: ev.AggregateID}
}

// states reads the checkpoints of the aggregates keys.
func (a *aggregates) states(ctx context.Context, store bookkeeping.Store, keys []aggregateKey) (map[aggregateKey]bookkeeping.AggregateState, error) {
	states, err := store.AggregateList(ctx, bookkeeping.AggregateListParams{Subscriber: a.name, Keys: keys})
	if err != nil {
		return nil, fmt.Errorf("read the aggregates' checkpoints: %w", err)
	}
	return states, nil
}

// afterDeadLetter records what a dead-lettered event of an ordered
// subscriber does to its aggregate: holds it (on_dead_letter=hold) or lets
// it pass (skip). An event held behind another changes nothing.
func (a *aggregates) afterDeadLetter(ctx context.Context, d *delivery) error {
	if d.ev.AggregateSeq == 0 || d.heldBy != 0 {
		return nil
	}
	ctx, cancel := bounded(ctx, a.cfg)
	defer cancel()
	p := bookkeeping.AggregateDeadLetterParams{Subscriber: a.name, Seq: d.ev.AggregateSeq, Event: d.ev.key(), Key: a.keyOf(d.ev)}
	record := a.store.AggregateHold
	if a.cfg.OnDeadLetter == "skip" {
		record = a.store.AggregatePass
	}
	if err := record(ctx, p); err != nil {
		return fmt.Errorf("record the dead letter in its aggregate's checkpoint: %w", err)
	}
	return nil
}
