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
// consumer's, so that an operator can tell it apart and `fanout provision`
// can make it before any reindex. A reindex runs as the operator identity: a consumer whose
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

// ReplayConsumerConfig is the reindex's consumer: the events the indexer
// handles (product changes, brand and category renames), without acks
// (the reader tracks its own position), in stream.ReaderConsumerConfig's
// one configuration. `fanout provision` makes it; a reindex moves it (a
// reset) and pulls, and never creates it with stream.provision verify or
// off, nor deletes it: an operator allowed to create it with a
// configuration of its choosing could make it push any writer's event
// into a subscriber's CONSUMER.RESET.
func ReplayConsumerConfig(events stream.Config) jetstream.ConsumerConfig {
	return stream.ReaderConsumerConfig(stream.ReindexConsumer,
		"fanout reindex: replays product, brand and category events onto a new search index (made by fanout provision; a reindex resets it and pulls)",
		replayFilters(events))
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

// start checks the consumer (stream.EnsureReader: with stream.provision
// auto it may create it) and moves it after the position read up to.
func (rr *replayReader) start() error {
	c, err := stream.EnsureReader(rr.ctx, rr.s, ReplayConsumerConfig(rr.events), rr.events.Provision == "auto")
	if err != nil {
		return err
	}
	rr.cons = c
	rr.delivered = 0 // a reset starts the consumer sequence again at 1
	return stream.ResetReader(rr.ctx, rr.s, stream.ReindexConsumer, rr.pos+1)
}

// restart checks and moves the consumer again, at most replayRestarts
// times: one the server lost is made again only with provisioning.
func (rr *replayReader) restart(cause error) error {
	if rr.restarts++; rr.restarts > replayRestarts {
		return fmt.Errorf("replay consumer %s: restarted %d times, last because of: %w", stream.ReindexConsumer, replayRestarts, cause)
	}
	return rr.start()
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
