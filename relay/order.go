package relay

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/fanout/fanout/outboxstore"
)

// aggregateKey names one aggregate.
type aggregateKey struct{ typ, id string }

func keyOf(rw row) aggregateKey { return aggregateKey{rw.AggregateType, rw.AggregateID} }

// aggregateOrder keeps each aggregate's events in order through the wal
// relay's publishes, which run concurrently (a chunk per transaction, up
// to relay.max_in_flight rows) and retry on their own: without it, an
// event whose publish failed and is retried after a backoff lands in the
// stream behind the next event of its aggregate, published meanwhile. The
// poll relay needs none of this: its claim takes an aggregate's next event
// only once the one before is published (see outbox's claimSQL).
//
// Rows enter in commit order (the decoder's), and each waits for the
// previous row of its aggregate to be done (acked, or marked failed)
// before it is published. It also remembers the aggregates held by a
// failed event (relay.on_failed hold): their later events are marked
// failed behind it (outboxstore.HeldBehindReason) and go back, in order, when
// an operator retries or skips it.
type aggregateOrder struct {
	mu   sync.Mutex
	last map[aggregateKey]*turn // the aggregate's latest entered row's
	held map[aggregateKey]heldBy
}

// turn is one row's place in its aggregate's order.
type turn struct {
	done      chan struct{} // closed when the row is done, or abandoned
	abandoned bool          // set before done closes: the row was not published
}

// heldBy is the failed event that holds its aggregate.
type heldBy struct {
	id  int64
	seq int64
}

func newAggregateOrder() *aggregateOrder {
	return &aggregateOrder{last: map[aggregateKey]*turn{}, held: map[aggregateKey]heldBy{}}
}

// ordered is one chunk's rows with their places in their aggregates'
// order.
type ordered struct {
	rows []row
	prev []*turn // the previous row of the row's aggregate (nil: none in flight)
	own  []*turn
}

// enter registers rows, in the order they were decoded.
func (o *aggregateOrder) enter(rows []row) *ordered {
	c := &ordered{rows: rows, prev: make([]*turn, len(rows)), own: make([]*turn, len(rows))}
	o.mu.Lock()
	defer o.mu.Unlock()
	for i, rw := range rows {
		k := keyOf(rw)
		c.prev[i] = o.last[k]
		c.own[i] = &turn{done: make(chan struct{})}
		o.last[k] = c.own[i]
	}
	return c
}

// leave marks row i of c done (abandoned: not published), letting the
// next row of its aggregate go (or, abandoned, stop as well: it must not
// enter the stream ahead of this one).
func (o *aggregateOrder) leave(c *ordered, i int, abandoned bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	select {
	case <-c.own[i].done:
		return
	default:
	}
	k := keyOf(c.rows[i])
	if o.last[k] == c.own[i] {
		delete(o.last, k)
	}
	c.own[i].abandoned = abandoned
	close(c.own[i].done)
}

// keep narrows c to the rows of kept (by id, in c's order, as kept has
// them), abandoning the others: rows a refetch found no longer pending.
func (o *aggregateOrder) keep(c *ordered, kept []row) *ordered {
	byID := make(map[int64]row, len(kept))
	for _, rw := range kept {
		byID[rw.ID] = rw
	}
	n := &ordered{}
	for i, rw := range c.rows {
		fresh, ok := byID[rw.ID]
		if !ok {
			o.leave(c, i, false) // whoever changed it owns it
			continue
		}
		n.rows, n.prev, n.own = append(n.rows, fresh), append(n.prev, c.prev[i]), append(n.own, c.own[i])
	}
	return n
}

// abandon marks every row of c not yet done abandoned.
func (o *aggregateOrder) abandon(c *ordered) {
	for i := range c.rows {
		o.leave(c, i, true)
	}
}

// hold records that the failed event rw holds its aggregate.
func (o *aggregateOrder) hold(rw row) {
	o.mu.Lock()
	defer o.mu.Unlock()
	k := keyOf(rw)
	if h, ok := o.held[k]; !ok || rw.AggregateSeq.Int64 < h.seq {
		o.held[k] = heldBy{id: rw.ID, seq: rw.AggregateSeq.Int64}
	}
}

// release forgets the hold on rw's aggregate if rw is what holds it (it
// was published after an operator retried it, or an operator skipped it).
func (o *aggregateOrder) release(rw row) {
	o.mu.Lock()
	defer o.mu.Unlock()
	k := keyOf(rw)
	if h, ok := o.held[k]; ok && h.id == rw.ID {
		delete(o.held, k)
	}
}

// heldBehind returns the failed event holding rw, if any: one of an
// earlier number in rw's aggregate. The event holding it passes (it was
// decoded again, or an operator returned it), and so do earlier ones.
func (o *aggregateOrder) heldBehind(rw row) (int64, bool) {
	if !rw.AggregateSeq.Valid {
		return 0, false
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	h, ok := o.held[keyOf(rw)]
	if !ok || rw.ID == h.id || rw.AggregateSeq.Int64 < h.seq {
		return 0, false
	}
	return h.id, true
}

// loadHolds reads the failed events that hold their aggregates, as the
// table has them when a stream starts.
func (o *aggregateOrder) loadHolds(ctx context.Context, store *outboxstore.Store) error {
	holding, err := store.HoldingEvents(ctx)
	if err != nil {
		return err
	}
	held := make(map[aggregateKey]heldBy, len(holding))
	for _, h := range holding {
		held[aggregateKey{typ: h.Aggregate.Type, id: h.Aggregate.ID}] = heldBy{id: h.ID, seq: h.Seq}
	}
	o.mu.Lock()
	o.held = held
	o.mu.Unlock()
	return nil
}

// publishOrdered publishes a chunk's rows from the slot, each once the
// previous row of its aggregate is done, and until every one has a PubAck
// or is marked failed (publishCaptured). It returns false if the relay
// stopped first, or a row before one of these was abandoned.
func (w *walCapture) publishOrdered(softCtx, hardCtx context.Context, c *ordered) bool {
	defer w.order.abandon(c) // a no-op for the rows done
	hold := w.store.OnFailed != outboxstore.SkipFailed
	left := make([]int, len(c.rows))
	for i := range left {
		left[i] = i
	}
	if w.hooks.Unordered {
		c.prev = make([]*turn, len(c.rows))
	}
	for len(left) > 0 {
		ready, waiting, ok := readyOf(c, left)
		if !ok {
			return false
		}
		if len(ready) == 0 {
			select {
			case <-c.prev[waiting[0]].done:
			case <-softCtx.Done():
				return false
			}
			continue
		}
		// With atomic batches, the rows waiting for one that is ready
		// (and so on) go in the same batch, behind it.
		if chained, rest := chainedOf(c, ready, waiting); len(chained) > len(ready) && w.pub.atomicOK.Load() {
			done, ok := w.publishChainCaptured(softCtx, hardCtx, c, chained, hold)
			if !ok {
				return false
			}
			if done {
				left = rest
				continue
			}
		}
		if !w.publishReady(softCtx, hardCtx, c, ready, hold) {
			return false
		}
		left = waiting
	}
	return true
}

// readyOf splits the rows of c at left into those whose previous row is
// done (ready) and those still waiting; ok is false if a previous row was
// abandoned.
func readyOf(c *ordered, left []int) (ready, waiting []int, ok bool) {
	for _, i := range left {
		p := c.prev[i]
		if p == nil {
			ready = append(ready, i)
			continue
		}
		select {
		case <-p.done:
			if p.abandoned {
				return nil, nil, false
			}
			ready = append(ready, i)
		default:
			waiting = append(waiting, i)
		}
	}
	return ready, waiting, true
}

// publishReady publishes the ready rows of c (publishCaptured), marking
// failed those held behind a failed event first, and lets each one's
// aggregate go on; false if the relay stopped first.
func (w *walCapture) publishReady(softCtx, hardCtx context.Context, c *ordered, ready []int, hold bool) bool {
	var publish []row
	var heldIDs []int64
	var heldReasons []string
	for _, i := range ready {
		rw := c.rows[i]
		if by, ok := w.order.heldBehind(rw); ok && hold {
			heldIDs = append(heldIDs, rw.ID)
			heldReasons = append(heldReasons, outboxstore.HeldBehindReason(by))
			continue
		}
		publish = append(publish, rw)
	}
	if len(heldIDs) > 0 {
		if !w.failCaptured(softCtx, heldIDs, heldReasons) {
			return false
		}
	}
	failed, ok := w.publishCaptured(softCtx, hardCtx, publish)
	if !ok {
		return false
	}
	for _, rw := range publish {
		switch {
		case !failed[rw.ID]:
			w.order.release(rw)
		case hold && rw.AggregateSeq.Valid:
			w.order.hold(rw)
		}
	}
	for _, i := range ready {
		w.order.leave(c, i, false)
	}
	return true
}

// chainedOf extends ready, the rows of c whose previous row is done, by
// the waiting rows whose previous row is among them (and so on), in c's
// order, which is their aggregates' (the decoder's); rest is the rows
// still waiting for a row outside c.
func chainedOf(c *ordered, ready, waiting []int) (chained, rest []int) {
	in := make(map[*turn]bool, len(ready)+len(waiting))
	for _, i := range ready {
		in[c.own[i]] = true
	}
	isReady := make(map[int]bool, len(ready))
	for _, i := range ready {
		isReady[i] = true
	}
	all := append(slices.Clone(ready), waiting...)
	slices.Sort(all)
	for _, i := range all {
		switch {
		case isReady[i]:
			chained = append(chained, i)
		case in[c.prev[i]]:
			in[c.own[i]] = true
			chained = append(chained, i)
		default:
			rest = append(rest, i)
		}
	}
	return chained, rest
}

// publishChainCaptured publishes the rows of c at idx, in that order, as
// atomic batches (publishChain), marking failed those held behind a failed
// event first, and records where they landed. done says whether every row
// is stored; if not, nothing is recorded and the rows go the usual way
// (publishCaptured), a wave at a time: those the batches stored are then
// duplicates JetStream drops. ok is false if the relay stopped first.
func (w *walCapture) publishChainCaptured(softCtx, hardCtx context.Context, c *ordered, idx []int, hold bool) (done, ok bool) {
	var publish []row
	var heldIDs []int64
	var heldReasons []string
	// A row held behind a failed event that is in the chain (returned by
	// an operator's retry, as the rows behind it are) goes behind it: the
	// hold is released when it is stored, with them.
	chained := make(map[int64]bool, len(idx))
	for _, i := range idx {
		chained[c.rows[i].ID] = true
	}
	for _, i := range idx {
		rw := c.rows[i]
		if by, isHeld := w.order.heldBehind(rw); isHeld && hold && !chained[by] {
			heldIDs = append(heldIDs, rw.ID)
			heldReasons = append(heldReasons, outboxstore.HeldBehindReason(by))
			continue
		}
		publish = append(publish, rw)
	}
	results, n, err := w.pub.publishChain(hardCtx, publish)
	if n < len(publish) {
		if hardCtx.Err() != nil {
			return false, false
		}
		if !errors.Is(err, errNotAtomic) {
			w.logger.Debug("atomic batch refused; its events go a wave at a time", "rows", len(publish)-n, "error", err)
		}
		return false, true
	}
	if len(heldIDs) > 0 && !w.failCaptured(softCtx, heldIDs, heldReasons) {
		return false, false
	}
	published := make([]Published, len(publish))
	landed := make([]outboxstore.Landed, len(publish))
	for j, rw := range publish {
		res := results[j]
		published[j] = Published{ID: rw.ID, CreatedAt: rw.CreatedAt.Time, AckedAt: res.ackedAt}
		landed[j] = outboxstore.Landed{ID: rw.ID, Seq: res.seq}
	}
	if !w.recordCaptured(hardCtx, landed) {
		return false, false
	}
	w.delivery.reportPublished(published, 0, 0)
	for _, rw := range publish {
		w.order.release(rw)
	}
	for _, i := range idx {
		w.order.leave(c, i, false)
	}
	return true, true
}
