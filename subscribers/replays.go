package subscribers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// A replay moves this subscriber's consumer to a stream position, so that
// it receives the events from there on again (its checkpoint skips those
// it handled). Only the subscriber may reset its own consumer: the
// operator's `fanout replay` records a request in Postgres, and the
// replayer of a running instance takes it, moves the consumer and records
// the outcome in the same transaction. A consumer therefore moves only
// when Postgres holds a request naming who asked, and a NATS credential
// alone moves no other role's consumer.
type replayer struct {
	name, streamName string
	pool             *pgxpool.Pool
	js               jetstream.JetStream
	logger           *slog.Logger
	failing          bool // the last look failed: said once, not every second
}

// replayPollInterval is how often a running instance looks for requests:
// `fanout replay` waits for the outcome.
const replayPollInterval = time.Second

// replayTimeout bounds one request's transaction: the take, the reset and
// the outcome.
const replayTimeout = 15 * time.Second

func (p *replayer) loop(ctx context.Context) {
	t := time.NewTicker(replayPollInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for p.takeOne(ctx) {
		}
	}
}

// takeOne carries out the oldest waiting request, if any, and reports
// whether it did. Postgres or NATS out of reach leaves the request for a
// later tick (until it lapses): an outage is not the request's failure.
func (p *replayer) takeOne(parent context.Context) bool {
	taken, outcome, err := p.carryOut(parent)
	if err != nil {
		if parent.Err() == nil && !p.failing { // not stopping: an outage
			p.failing = true
			p.logger.Warn("replays: cannot look for or carry out a request now (Postgres or NATS out of reach); looking again every second", "error", err)
		}
		return false
	}
	if p.failing {
		p.failing = false
		p.logger.Info("replays: looking for requests again")
	}
	switch {
	case outcome == "":
		return false
	case outcome == bookkeeping.ReplayMoved:
		p.logger.Info("replay: consumer moved; the events from there on come again, and its checkpoint skips those it handled",
			"request", taken.ID, "stream", taken.Stream, "from_seq", taken.FromSeq, "requested_by", taken.RequestedBy, "reason", taken.Reason)
	default:
		p.logger.Warn("replay refused", "request", taken.ID, "stream", taken.Stream, "from_seq", taken.FromSeq,
			"requested_by", taken.RequestedBy, "outcome", outcome)
	}
	return true
}

// carryOut takes a request (none: no outcome), moves the consumer and
// records the outcome, in one transaction. Once the consumer has moved,
// the outcome is recorded even if the runner is stopping meanwhile
// (within replayTimeout): a move left unrecorded would read as a lapse.
func (p *replayer) carryOut(parent context.Context) (taken bookkeeping.TakenReplay, outcome string, err error) {
	ctx, cancel := context.WithTimeout(parent, replayTimeout)
	defer cancel()
	tx, err := p.pool.Begin(ctx)
	if err != nil {
		return taken, "", err
	}
	finish, cancelFinish := context.WithTimeout(context.WithoutCancel(parent), replayTimeout)
	defer cancelFinish()
	defer tx.Rollback(finish) //nolint:errcheck // after a commit, a no-op
	rs := bookkeeping.NewReplays(tx)
	taken, ok, err := rs.Take(ctx, p.name)
	if err != nil || !ok {
		return taken, "", err
	}
	if outcome, err = p.move(ctx, taken); err != nil {
		return taken, "", err
	}
	if err := rs.Finish(finish, taken.ID, outcome); err != nil {
		return taken, "", err
	}
	return taken, outcome, tx.Commit(finish)
}

// move resets the consumer to the request's position. Its outcome is
// ReplayMoved or why the request cannot be carried out; an error is an
// outage (the request stays).
func (p *replayer) move(ctx context.Context, r bookkeeping.TakenReplay) (string, error) {
	if r.Stream != p.streamName {
		return fmt.Sprintf("failed: subscriber %s consumes stream %s, not %s", p.name, p.streamName, r.Stream), nil
	}
	// A replay moves the consumer back, to events it received: moved past
	// its ack floor, it would skip the events in between.
	c, err := p.js.Consumer(ctx, r.Stream, p.name)
	if err != nil {
		return "", fmt.Errorf("read the consumer: %w", err)
	}
	if floor := c.CachedInfo().AckFloor.Stream; r.FromSeq > floor+1 {
		return fmt.Sprintf("failed: sequence %d is past the consumer's ack floor %d: a replay moves a consumer back, and moved forward it would skip the events in between", r.FromSeq, floor), nil
	}
	_, err = p.js.ResetConsumerToSequence(ctx, r.Stream, p.name, r.FromSeq)
	switch {
	case err == nil:
		return bookkeeping.ReplayMoved, nil
	case errors.Is(err, jetstream.ErrConsumerInvalidReset):
		return fmt.Sprintf("failed: the consumer's start position does not allow sequence %d (was it created with subscribers.start=new?): %v", r.FromSeq, err), nil
	case jsretry.Transient(ctx, err) || ctx.Err() != nil:
		return "", fmt.Errorf("reset the consumer: %w", err)
	default:
		return "failed: " + err.Error(), nil
	}
}
