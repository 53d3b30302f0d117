package searchindex

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The consumer `fanout reindex` reads the stream through is
// stream.ReindexConsumer. Its name is fixed, not generated like an ordered
// consumer's, so that an operator can tell it apart (and a leftover one is
// replaced). A reindex runs as the operator identity: a consumer whose
// filter its creator picks is no right to give a subscriber's user, which
// could then read events that are not its own
// (deploy/nats/nats-server.conf). Its name starts with
// stream.OperatorConsumerPrefix, which no subscriber's name may, so a
// permission on it can never reach a subscriber's consumer. Reindexes are
// serialized (Lock), so one name is enough.

const (
	replayFetch = 500
	// replayRestarts bounds how often one replay starts its consumer again
	// (after a gap, or when the server lost it).
	replayRestarts = 10
)

// consumerGone reports an error that means the replay consumer no longer
// exists: deleted as inactive, or lost with a cluster node (it has one
// replica, in memory).
func consumerGone(err error) bool {
	return errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrConsumerDeleted) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoHeartbeat)
}

// replayConsumerConfig reads the events the indexer handles (product
// changes, brand and category renames) from sequence from on, without acks (the reader tracks its own position), and lives on
// the server only while a reindex reads it: a reindex that died leaves it
// behind for ten minutes at most. (A pull consumer is inactive while no
// pull is waiting, which includes the time a batch is being indexed: the
// threshold is long so that a slow engine does not delete it mid-replay.)
func replayConsumerConfig(events stream.Config, from uint64) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Name:              stream.ReindexConsumer,
		Description:       "fanout reindex: replays product, brand and category events onto a new search index; deleted when the reindex ends",
		FilterSubjects:    replayFilters(events),
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       from,
		AckPolicy:         jetstream.AckNonePolicy,
		InactiveThreshold: 10 * time.Minute,
		MemoryStorage:     true,
		Replicas:          1,
	}
}

// replayFilters are the indexer's own filter subjects: a replay that missed
// an event type the indexer handles (a category rename) would swap in an
// index that lacks its changes.
func replayFilters(events stream.Config) []string {
	var filters []string
	for _, t := range eventTypes {
		filters = append(filters, events.SubjectPrefix+"."+t)
	}
	return filters
}

// ReadEvents calls fn, in stream order, with the indexer's events stored
// after sequence after, until the stream holds no more of them or position
// upTo is reached. It returns how many events it passed to fn and
// the stream position it read up to.
//
// Messages of a consumer without acks are not redelivered, so the reader
// checks that consumer sequences have no gap (a message lost on a broken
// connection) and, on one, starts a new consumer after the last message it
// has: what an ordered consumer does, under a name a permission can name.
func ReadEvents(ctx context.Context, js jetstream.JetStream, events stream.Config, after, upTo uint64, fn func([]subscribers.Event) error) (read int, pos uint64, err error) {
	if upTo <= after {
		return 0, after, nil
	}
	s, err := js.Stream(ctx, events.Name)
	if err != nil {
		return 0, after, fmt.Errorf("stream %s: %w", events.Name, err)
	}
	rr := &replayReader{ctx: ctx, s: s, events: events, pos: after}
	if err := rr.start(); err != nil {
		return 0, rr.pos, err
	}
	defer rr.close()
	for rr.pos < upTo {
		if err := ctx.Err(); err != nil {
			return read, rr.pos, err
		}
		n, done, err := rr.next(fn)
		read += n
		if err != nil {
			return read, rr.pos, err
		}
		if done {
			break
		}
	}
	return read, rr.pos, nil
}

// replayReader is ReadEvents' consumer: without acks, started again after
// the last message it has when its sequence shows a gap.
type replayReader struct {
	ctx       context.Context
	s         jetstream.Stream
	events    stream.Config
	cons      jetstream.Consumer
	pos       uint64 // the stream position read up to
	delivered uint64 // the last consumer sequence received
	restarts  int
}

// start makes the consumer, after the position read up to.
func (rr *replayReader) start() error {
	// A consumer of this name is left over from a reindex that died, or
	// from this one before a gap: either way it is done with.
	if err := rr.s.DeleteConsumer(rr.ctx, stream.ReindexConsumer); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return fmt.Errorf("delete consumer %s: %w", stream.ReindexConsumer, err)
	}
	c, err := rr.s.CreateConsumer(rr.ctx, replayConsumerConfig(rr.events, rr.pos+1))
	if err != nil {
		return fmt.Errorf("create consumer %s: %w", stream.ReindexConsumer, err)
	}
	rr.cons = c
	return nil
}

// restart starts the consumer again, at most replayRestarts times.
func (rr *replayReader) restart(cause error) error {
	if rr.restarts++; rr.restarts > replayRestarts {
		return fmt.Errorf("replay consumer %s: restarted %d times, last because of: %w", stream.ReindexConsumer, replayRestarts, cause)
	}
	rr.delivered = 0
	return rr.start()
}

func (rr *replayReader) close() {
	dctx, cancel := context.WithTimeout(context.WithoutCancel(rr.ctx), 10*time.Second)
	defer cancel()
	_ = rr.s.DeleteConsumer(dctx, stream.ReindexConsumer) // if this fails, the inactive threshold removes it
}

// next fetches a batch and passes its events to fn. done: the consumer
// has delivered everything there is, and all of it arrived.
func (rr *replayReader) next(fn func([]subscribers.Event) error) (read int, done bool, err error) {
	batch, err := rr.cons.Fetch(replayFetch, jetstream.FetchMaxWait(time.Second))
	if err != nil {
		if consumerGone(err) {
			return 0, false, rr.restart(err)
		}
		return 0, false, err
	}
	evs, received, gap := rr.receive(batch)
	if len(evs) > 0 {
		if err := fn(evs); err != nil {
			rr.pos = evs[0].StreamSeq - 1
			return 0, false, err
		}
		read = len(evs)
	}
	if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, nats.ErrTimeout) {
		if !consumerGone(err) {
			return read, false, err
		}
		gap = true
	}
	if gap {
		return read, false, rr.restart(errors.New("a gap in the consumer sequence"))
	}
	if received < replayFetch {
		done, err := rr.drained()
		return read, done, err
	}
	return read, false, nil
}

// receive reads a batch's events, up to a gap in the consumer sequence (a
// message lost on a broken connection): everything after it is read again.
func (rr *replayReader) receive(batch jetstream.MessageBatch) (evs []subscribers.Event, received int, gap bool) {
	for m := range batch.Messages() {
		received++
		meta, err := m.Metadata()
		if gap || err != nil || meta.Sequence.Consumer != rr.delivered+1 {
			gap = true
			continue
		}
		rr.delivered, rr.pos = meta.Sequence.Consumer, meta.Sequence.Stream
		ev, err := subscribers.EventFromMsg(m, rr.events.SubjectPrefix)
		if err != nil {
			continue // not an outbox event: the indexer dead-letters it, a replay skips it
		}
		evs = append(evs, ev)
	}
	return evs, received, gap
}

// drained reports whether the consumer has nothing left to deliver, and
// everything it delivered arrived: the rest of the stream concerns no
// product. Messages delivered but lost on the way (a connection cut at the
// end of a fetch) leave no later message to reveal the gap; the delivered
// count does.
func (rr *replayReader) drained() (bool, error) {
	info, err := rr.cons.Info(rr.ctx)
	if consumerGone(err) {
		return false, rr.restart(err)
	}
	if err != nil {
		return false, err
	}
	if info.NumPending != 0 {
		return false, nil
	}
	if info.Delivered.Consumer == rr.delivered {
		return true, nil
	}
	return false, rr.restart(errors.New("messages delivered but not received"))
}
