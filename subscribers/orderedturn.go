package subscribers

// Whose turn it is, for an ordered subscriber: each aggregate's received
// events in number order, the checkpoint as the dispatcher last read it,
// and the wait for an earlier event that has not arrived (a gap) before the
// next one is applied marked AfterGap.

import (
	"context"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

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
	// firstSeen: the aggregate has no checkpoint row and the consumer
	// began after the stream's start (subscribers.start new or time), so
	// its earlier events may never come: the first one seen is applied
	// marked AfterGap, at once.
	firstSeen bool
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

// maxIdleLines bounds the aggregates whose checkpoint the dispatcher
// remembers while none of their events waits.
const maxIdleLines = 100_000

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
		od.r.logger.Debug("an aggregate's event waits for an earlier one", "aggregate_type", l.key.Type, "aggregate_id", l.key.ID,
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
		"aggregate_type", l.key.Type, "aggregate_id", l.key.ID, "number", head.seq, "applied", l.lastSeq,
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
	keys := make([]aggregateKey, len(lines))
	for i, l := range lines {
		keys[i] = l.key
	}
	qctx, cancel := bounded(ctx, od.r.cfg)
	states, err := od.r.aggregates.states(qctx, od.r.store, keys)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			od.r.health.MarkDown(DependencyPostgres, err)
			od.loadWait = time.Now().Add(time.Second)
		}
		od.toLoad = append(lines, od.toLoad...)
		return
	}
	for _, l := range lines {
		st := states[l.key]
		l.loading, l.loaded = false, true
		l.lastSeq, l.held, l.firstSeen = st.Last, st.HeldBy != 0, false
		if !st.Exists && od.r.cfg.Start != "all" && len(l.waiting) > 0 && l.waiting[0].seq > 1 {
			// The consumer began after the stream's start: the aggregate's
			// history begins, for this subscriber, with the first event
			// seen, which its handler learns is not the aggregate's first.
			l.lastSeq, l.firstSeen = l.waiting[0].seq-1, true
		}
		od.evaluate(l)
	}
}
