package subscribers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// Observer is told what a runner does; metrics implement it. Its methods
// are called from several goroutines and must not block.
type Observer interface {
	// Handled reports events whose effect committed, and how long their
	// batch took.
	Handled(subscriber string, n int, took time.Duration)
	// Skipped reports events already in the checkpoint (redeliveries,
	// duplicate publishes).
	Skipped(subscriber string, n int)
	// Retried reports events naked for a later redelivery.
	Retried(subscriber string, n int)
	// DeadLettered reports events sent to the dead letters.
	DeadLettered(subscriber string, n int)
}

// NopObserver ignores everything.
type NopObserver struct{}

func (NopObserver) Handled(string, int, time.Duration) {}
func (NopObserver) Skipped(string, int)                {}
func (NopObserver) Retried(string, int)                {}
func (NopObserver) DeadLettered(string, int)           {}

// Options are a runner's collaborators.
type Options struct {
	Handler  Handler
	Config   config.Subscribers
	Stream   config.Stream
	Pool     *pgxpool.Pool
	Conn     *nats.Conn
	Logger   *slog.Logger
	Observer Observer // optional
	// BeforeAck, when set, runs after a batch's effects and checkpoints are
	// recorded and before its messages are acked. Fault-injection tests use
	// it to die at the worst moment.
	BeforeAck func(ctx context.Context, ids []int64)
}

// Runner runs one subscriber: its consumer, its workers, its dead letters.
type Runner struct {
	opts    Options
	name    string
	eventH  EventHandler
	txH     TxHandler
	cfg     config.Subscribers
	logger  *slog.Logger
	obs     Observer
	js      jetstream.JetStream
	stream  jetstream.Stream
	cons    jetstream.Consumer
	iter    jetstream.MessagesContext
	advSub  *nats.Subscription
	workers sync.WaitGroup
	loops   sync.WaitGroup

	startOnce, stopOnce    sync.Once
	cancelSoft, cancelHard context.CancelFunc
	stopErr                error
}

// New checks the handler and returns a runner; nothing runs until Start.
func New(opts Options) (*Runner, error) {
	h := opts.Handler
	if h == nil {
		return nil, errors.New("subscriber: no handler")
	}
	if !outbox.ValidSubjectToken(h.Name()) || strings.ContainsAny(h.Name(), `/\`) {
		return nil, fmt.Errorf("subscriber name %q: must be one subject token (letters, digits, '-', '_')", h.Name())
	}
	if len(h.EventTypes()) == 0 {
		return nil, fmt.Errorf("subscriber %s: no event types", h.Name())
	}
	r := &Runner{opts: opts, name: h.Name(), cfg: opts.Config, obs: opts.Observer}
	r.logger = opts.Logger.With("subscriber", h.Name())
	if r.obs == nil {
		r.obs = NopObserver{}
	}
	switch hh := h.(type) {
	case TxHandler:
		r.txH = hh
	case EventHandler:
		r.eventH = hh
	default:
		return nil, fmt.Errorf("subscriber %s implements neither Handle nor HandleTx", h.Name())
	}
	js, err := jetstream.New(opts.Conn)
	if err != nil {
		return nil, err
	}
	r.js = js
	return r, nil
}

// Name is the subscriber's name.
func (r *Runner) Name() string { return r.name }

// Start provisions (per stream.provision) or binds the subscriber's consumer
// and the dead-letter stream, then starts consuming. It returns once running;
// ctx bounds the start only.
func (r *Runner) Start(ctx context.Context) error {
	err := errors.New("subscriber already started")
	r.startOnce.Do(func() { err = r.start(ctx) })
	return err
}

func (r *Runner) start(ctx context.Context) error {
	if err := jsretry.Do(ctx, r.logger, "provision the dead-letter stream", func() error {
		return ensureDeadLetterStream(ctx, r.js, r.cfg, r.opts.Stream.Replicas, r.opts.Stream.Provision)
	}); err != nil {
		return err
	}
	stream, err := r.waitForStream(ctx)
	if err != nil {
		return fmt.Errorf("subscriber %s: stream %s: %w", r.name, r.opts.Stream.Name, err)
	}
	r.stream = stream
	var cons jetstream.Consumer
	err = jsretry.Do(ctx, r.logger, "provision the consumer", func() error {
		var err error
		cons, err = ensureConsumer(ctx, stream, ConsumerConfig(r.opts.Handler, r.cfg, r.opts.Stream), r.opts.Stream.Provision)
		return err
	})
	if err != nil {
		return fmt.Errorf("subscriber %s: %w", r.name, err)
	}
	r.cons = cons
	// A small buffer: a draining instance finishes what it holds, so what
	// it holds should be little.
	iter, err := cons.Messages(jetstream.PullMaxMessages(r.cfg.BatchSize * r.cfg.Concurrency))
	if err != nil {
		return fmt.Errorf("subscriber %s: consume: %w", r.name, err)
	}
	r.iter = iter
	advisories := fmt.Sprintf("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.%s.%s", r.opts.Stream.Name, r.name)
	r.advSub, err = r.opts.Conn.QueueSubscribe(advisories, "fanout-"+r.name+"-advisories", r.onMaxDeliveries)
	if err == nil {
		// A subscription the server refuses (permissions) fails only
		// asynchronously: flush, then look, so Start says so.
		if err = r.opts.Conn.FlushTimeout(5 * time.Second); err == nil {
			if last := r.opts.Conn.LastError(); last != nil && strings.Contains(last.Error(), advisories) {
				err = last
			}
		}
	}
	if err != nil {
		iter.Stop()
		if r.advSub != nil {
			_ = r.advSub.Unsubscribe()
		}
		return fmt.Errorf("subscriber %s: subscribe to max-delivery advisories: %w", r.name, err)
	}

	hardCtx, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	softCtx, cancelSoft := context.WithCancel(hardCtx)
	r.cancelHard, r.cancelSoft = cancelHard, cancelSoft

	batches := make(chan []jetstream.Msg)
	r.loops.Add(2)
	go func() {
		defer r.loops.Done()
		r.dispatch(hardCtx, batches)
	}()
	go func() {
		defer r.loops.Done()
		r.pruneLoop(softCtx)
	}()
	for range r.cfg.Concurrency {
		r.workers.Add(1)
		go func() {
			defer r.workers.Done()
			for batch := range batches {
				r.process(hardCtx, batch)
			}
		}()
	}
	info := cons.CachedInfo()
	r.logger.Info("subscriber started", "consumer", info.Name, "filter_subjects", info.Config.FilterSubjects,
		"pending", info.NumPending, "concurrency", r.cfg.Concurrency, "batch_size", r.cfg.BatchSize)
	return nil
}

// waitForStream returns the events stream, waiting (as long as ctx allows)
// for the relay to create it: subscribers may well start first.
func (r *Runner) waitForStream(ctx context.Context) (jetstream.Stream, error) {
	wait := 100 * time.Millisecond
	logged := time.Time{}
	for {
		s, err := r.js.Stream(ctx, r.opts.Stream.Name)
		if err == nil || !(errors.Is(err, jetstream.ErrStreamNotFound) || jsretry.Transient(ctx, err)) {
			return s, err
		}
		if time.Since(logged) > 10*time.Second {
			r.logger.Warn("waiting for the relay to create the stream", "stream", r.opts.Stream.Name)
			logged = time.Now()
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (the relay creates it with stream.provision=auto)", err)
		case <-time.After(wait):
		}
		wait = min(wait*2, 2*time.Second)
	}
}

// Stop drains: no new messages are pulled, the ones already received are
// handled and acked, then it returns. If ctx ends first, the handlers' context
// is cancelled (their events are redelivered after the ack wait) and Stop
// returns ctx's error. Stop is idempotent.
func (r *Runner) Stop(ctx context.Context) error {
	r.stopOnce.Do(func() {
		if r.cancelSoft == nil {
			return
		}
		_ = r.advSub.Unsubscribe()
		r.iter.Drain()
		r.cancelSoft()
		done := make(chan struct{})
		go func() {
			r.loops.Wait()
			r.workers.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-ctx.Done():
			r.stopErr = fmt.Errorf("subscriber %s: stop: events still in flight: %w", r.name, ctx.Err())
			r.cancelHard()
			r.iter.Stop()
			<-done
		}
		r.cancelHard()
		r.logger.Info("subscriber stopped")
	})
	return r.stopErr
}

// gatherWait is how long the dispatcher waits for more messages to fill a
// batch once it has one: short, so a lone event is not held back.
const gatherWait = 2 * time.Millisecond

// dispatch groups received messages into batches for the workers, until
// the iterator is drained or stopped.
func (r *Runner) dispatch(ctx context.Context, batches chan<- []jetstream.Msg) {
	defer close(batches)
	for {
		msg, err := r.iter.Next(jetstream.NextContext(ctx))
		if err != nil {
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) || ctx.Err() != nil {
				return
			}
			r.logger.Warn("receive", "error", err)
			continue
		}
		batch := []jetstream.Msg{msg}
		closed := false
		for len(batch) < r.cfg.BatchSize {
			m, err := r.iter.Next(jetstream.NextMaxWait(gatherWait))
			if err != nil {
				closed = errors.Is(err, jetstream.ErrMsgIteratorClosed)
				break
			}
			batch = append(batch, m)
		}
		select {
		case batches <- batch:
		case <-ctx.Done():
			return
		}
		if closed {
			return
		}
	}
}

// delivery is one received message and the event it carries.
type delivery struct {
	msg jetstream.Msg
	ev  Event
}

func (r *Runner) process(ctx context.Context, msgs []jetstream.Msg) {
	start := time.Now()
	ds := make([]delivery, 0, len(msgs))
	for _, m := range msgs {
		ev, err := r.parse(m)
		if err != nil {
			r.fail(ctx, delivery{msg: m, ev: ev}, Permanent(err))
			continue
		}
		// Delivered once more than max_deliver: the last attempt ended with
		// no outcome at all (the handler hung, or its process died).
		if ev.Delivery > uint64(r.cfg.MaxDeliver) {
			r.deadLetter(ctx, delivery{msg: m, ev: ev},
				fmt.Sprintf("no outcome after %d deliveries (the handler hung or its process died each time)", r.cfg.MaxDeliver))
			continue
		}
		ds = append(ds, delivery{msg: m, ev: ev})
	}
	if len(ds) == 0 {
		return
	}
	stop := r.keepAlive(ds)
	defer stop()
	if r.txH != nil {
		r.processTx(ctx, ds, start)
	} else {
		r.processEach(ctx, ds, start)
	}
}

// keepAlive tells JetStream the batch is still being worked on, so long
// work is not redelivered to another instance mid-way.
func (r *Runner) keepAlive(ds []delivery) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(r.cfg.AckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				for _, d := range ds {
					_ = d.msg.InProgress()
				}
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

func (r *Runner) parse(m jetstream.Msg) (Event, error) {
	return EventFromMsg(m, r.opts.Stream.SubjectPrefix)
}

// EventFromMsg reads the event a relayed message carries; subjectPrefix is
// the stream's (stream.subject_prefix). Its error says why a message is not
// an outbox event; the Event is filled as far as it could be.
func EventFromMsg(m jetstream.Msg, subjectPrefix string) (Event, error) {
	ev, err := EventFromParts(m.Data(), m.Headers(), m.Subject(), subjectPrefix)
	if md, merr := m.Metadata(); merr == nil {
		ev.StreamSeq, ev.Delivery = md.Sequence.Stream, md.NumDelivered
	}
	return ev, err
}

// EventFromParts reads an event from a message's body, headers and subject
// (for messages read from a stream directly, such as dead letters).
func EventFromParts(data []byte, h nats.Header, subject, subjectPrefix string) (Event, error) {
	ev := Event{Payload: data, Headers: h, Subject: subject}
	ev.Type = strings.TrimPrefix(subject, subjectPrefix+".")
	idText := h.Get(outbox.EventIDHeader)
	id, err := strconv.ParseInt(idText, 10, 64)
	if err != nil || id <= 0 {
		return ev, fmt.Errorf("message carries no valid %s header (got %q): not an outbox event", outbox.EventIDHeader, idText)
	}
	ev.ID = id
	if t := h.Get(outbox.EventTypeHeader); t != "" {
		ev.Type = t
	}
	ev.AggregateType = h.Get(outbox.AggregateTypeHeader)
	ev.AggregateID = h.Get(outbox.AggregateIDHeader)
	ev.CreatedAt, _ = time.Parse(time.RFC3339Nano, h.Get(outbox.CreatedAtHeader))
	return ev, nil
}

const (
	// checkpointSQL claims the batch's events in the checkpoint; RETURNING
	// names the ones not processed before. The ids are sorted, so two
	// transactions claiming overlapping batches lock in the same order.
	checkpointSQL = `
INSERT INTO processed_events (subscriber, event_id)
SELECT $1, id FROM unnest($2::bigint[]) AS id
ON CONFLICT DO NOTHING
RETURNING event_id`

	processedSQL = `SELECT event_id FROM processed_events WHERE subscriber = $1 AND event_id = ANY($2)`
)

// processTx handles a batch in one transaction with its checkpoint rows; if
// any event fails, the batch rolls back and each event is handled alone.
func (r *Runner) processTx(ctx context.Context, ds []delivery, start time.Time) {
	fresh, err := r.txBatch(ctx, ds)
	if err == nil {
		r.succeeded(ctx, ds, fresh, start)
		return
	}
	if len(ds) == 1 {
		r.fail(ctx, ds[0], err)
		return
	}
	r.logger.Debug("batch failed, handling its events one by one", "events", len(ds), "error", err)
	for _, d := range ds {
		one := []delivery{d}
		fresh, err := r.txBatch(ctx, one)
		if err != nil {
			r.fail(ctx, d, err)
			continue
		}
		r.succeeded(ctx, one, fresh, time.Now())
	}
}

// txBatch runs the handler on the batch's new events in one transaction and
// returns how many were new.
func (r *Runner) txBatch(ctx context.Context, ds []delivery) (fresh int, err error) {
	ids := make([]int64, len(ds))
	for i, d := range ds {
		ids[i] = d.ev.ID
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	// A hung handler must not hold its events forever (the in-progress
	// signals would keep them from being redelivered): bound the attempt.
	ctx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout)
	defer cancel()
	err = pgx.BeginFunc(ctx, r.opts.Pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, checkpointSQL, r.name, ids)
		if err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
		newIDs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
		todo := make(map[int64]bool, len(newIDs))
		for _, id := range newIDs {
			todo[id] = true
		}
		fresh = len(newIDs)
		var evs []Event
		for _, d := range ds {
			if todo[d.ev.ID] {
				delete(todo, d.ev.ID) // a duplicate in the same batch runs once
				evs = append(evs, d.ev)
			}
		}
		if bh, ok := r.txH.(BatchTxHandler); ok && len(evs) > 1 {
			if err := r.callBatchTx(ctx, bh, tx, evs); err != nil {
				return fmt.Errorf("batch of %d events: %w", len(evs), err)
			}
			return nil
		}
		for _, ev := range evs {
			if err := r.callTx(ctx, tx, ev); err != nil {
				return &eventError{id: ev.ID, err: err}
			}
		}
		return nil
	})
	var ee *eventError
	if errors.As(err, &ee) {
		return 0, ee.err
	}
	return fresh, err
}

// eventError carries a handler's error out of the transaction unchanged.
type eventError struct {
	id  int64
	err error
}

func (e *eventError) Error() string { return fmt.Sprintf("event %d: %v", e.id, e.err) }

func (r *Runner) callTx(ctx context.Context, tx pgx.Tx, ev Event) (err error) {
	defer recoverHandler(ev, &err)
	ctx, span := r.eventContext(ctx, ev)
	defer span.End()
	return r.txH.HandleTx(ctx, tx, ev)
}

func (r *Runner) callBatchTx(ctx context.Context, bh BatchTxHandler, tx pgx.Tx, evs []Event) (err error) {
	defer recoverHandler(evs[0], &err)
	ctx, span := r.batchContext(ctx, evs)
	defer span.End()
	return bh.HandleBatchTx(ctx, tx, evs)
}

// callEach runs the handler on each event: in one call for a
// BatchEventHandler, else one by one.
func (r *Runner) callEach(ctx context.Context, ds []delivery) []error {
	errs := make([]error, len(ds))
	if len(ds) == 0 {
		return errs
	}
	if bh, ok := r.eventH.(BatchEventHandler); ok && len(ds) > 1 {
		evs := make([]Event, len(ds))
		for i, d := range ds {
			evs[i] = d.ev
		}
		func() {
			defer func() {
				if p := recover(); p != nil {
					for i := range errs {
						errs[i] = fmt.Errorf("handler panicked on a batch: %v\n%s", p, debug.Stack())
					}
				}
			}()
			hctx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout) // see txBatch
			defer cancel()
			hctx, span := r.batchContext(hctx, evs)
			defer span.End()
			got := bh.HandleBatch(hctx, evs)
			if len(got) != len(errs) {
				err := fmt.Errorf("handler returned %d outcomes for %d events", len(got), len(errs))
				for i := range errs {
					errs[i] = err
				}
				return
			}
			copy(errs, got)
		}()
		return errs
	}
	for i, d := range ds {
		errs[i] = r.call(ctx, d.ev)
	}
	return errs
}

func (r *Runner) call(ctx context.Context, ev Event) (err error) {
	defer recoverHandler(ev, &err)
	ctx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout) // see txBatch
	defer cancel()
	ctx, span := r.eventContext(ctx, ev)
	defer span.End()
	return r.eventH.Handle(ctx, ev)
}

func recoverHandler(ev Event, err *error) {
	if p := recover(); p != nil {
		*err = fmt.Errorf("handler panicked on event %d: %v\n%s", ev.ID, p, debug.Stack())
	}
}

// processEach handles the batch's events one at a time (their effects are
// outside Postgres), then checkpoints the ones that succeeded.
func (r *Runner) processEach(ctx context.Context, ds []delivery, start time.Time) {
	ids := make([]int64, len(ds))
	for i, d := range ds {
		ids[i] = d.ev.ID
	}
	rows, err := r.opts.Pool.Query(ctx, processedSQL, r.name, ids)
	var done []int64
	if err == nil {
		done, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	}
	if err != nil {
		r.logger.Warn("read checkpoint; the batch will be redelivered", "error", err)
		for _, d := range ds {
			_ = d.msg.NakWithDelay(r.cfg.RetryMin)
		}
		r.obs.Retried(r.name, len(ds))
		return
	}
	seen := make(map[int64]bool, len(ds))
	for _, id := range done {
		seen[id] = true
	}
	var ok, todo []delivery
	var handled []int64
	skipped := 0
	for _, d := range ds {
		if seen[d.ev.ID] {
			ok = append(ok, d)
			skipped++
			continue
		}
		// A second copy of the event in this batch is acked as a duplicate;
		// if the first copy fails, it is the one redelivered.
		seen[d.ev.ID] = true
		todo = append(todo, d)
	}
	errs := r.callEach(ctx, todo)
	for i, d := range todo {
		if errs[i] != nil {
			r.fail(ctx, d, errs[i])
			continue
		}
		ok = append(ok, d)
		handled = append(handled, d.ev.ID)
	}
	if len(handled) > 0 {
		slices.Sort(handled)
		if _, err := r.opts.Pool.Exec(ctx, `
INSERT INTO processed_events (subscriber, event_id)
SELECT $1, id FROM unnest($2::bigint[]) AS id
ON CONFLICT DO NOTHING`, r.name, handled); err != nil {
			// The effects happened; without the checkpoint, a redelivery
			// runs the (idempotent) handler again.
			r.logger.Warn("record checkpoint; the batch will be redelivered", "error", err)
			for _, d := range ok {
				_ = d.msg.NakWithDelay(r.cfg.RetryMin)
			}
			r.obs.Retried(r.name, len(ok))
			return
		}
	}
	r.beforeAck(ctx, ok)
	if ctx.Err() != nil {
		return // hard stop: the events come back after the ack wait
	}
	r.ack(ctx, ok, false)
	r.obs.Handled(r.name, len(handled), time.Since(start))
	r.logger.Debug("batch handled", "events", len(handled), "skipped", skipped, "redelivered", redelivered(ds), "took", time.Since(start))
	if skipped > 0 {
		r.obs.Skipped(r.name, skipped)
	}
}

// succeeded acks a committed batch (double ack: the server confirms, so a
// lost ack cannot make JetStream redeliver behind our back unnoticed).
func (r *Runner) succeeded(ctx context.Context, ds []delivery, fresh int, start time.Time) {
	r.beforeAck(ctx, ds)
	if ctx.Err() != nil {
		return // hard stop: the events come back after the ack wait, and are skipped
	}
	r.ack(ctx, ds, true)
	r.obs.Handled(r.name, fresh, time.Since(start))
	r.logger.Debug("batch handled", "events", fresh, "skipped", len(ds)-fresh, "redelivered", redelivered(ds), "first_event_id", ds[0].ev.ID, "took", time.Since(start))
	if skipped := len(ds) - fresh; skipped > 0 {
		r.obs.Skipped(r.name, skipped)
	}
}

// redelivered counts the deliveries that were not an event's first.
func redelivered(ds []delivery) int {
	n := 0
	for _, d := range ds {
		if d.ev.Delivery > 1 {
			n++
		}
	}
	return n
}

func (r *Runner) beforeAck(ctx context.Context, ds []delivery) {
	if r.opts.BeforeAck == nil || len(ds) == 0 {
		return
	}
	ids := make([]int64, len(ds))
	for i, d := range ds {
		ids[i] = d.ev.ID
	}
	r.opts.BeforeAck(ctx, ids)
}

// ackParallelism bounds concurrent double acks: each is a round trip.
const ackParallelism = 64

func (r *Runner) ack(ctx context.Context, ds []delivery, double bool) {
	if !double {
		for _, d := range ds {
			if err := d.msg.Ack(); err != nil {
				r.logger.Warn("ack", "event_id", d.ev.ID, "error", err)
			}
		}
		return
	}
	g, gctx := errgroup.WithContext(context.WithoutCancel(ctx))
	g.SetLimit(ackParallelism)
	for _, d := range ds {
		g.Go(func() error {
			actx, cancel := context.WithTimeout(gctx, 5*time.Second)
			defer cancel()
			if err := d.msg.DoubleAck(actx); err != nil {
				// The effect is committed with its checkpoint: a redelivery
				// will be skipped.
				r.logger.Warn("double ack", "event_id", d.ev.ID, "error", err)
			}
			return nil
		})
	}
	_ = g.Wait()
}

// fail decides a failed event's fate: dead letter, or a nak with a delay.
func (r *Runner) fail(ctx context.Context, d delivery, err error) {
	if ctx.Err() != nil {
		// Hard stop: the failure is ours, not the event's. Leave it
		// unacked; JetStream redelivers it after the ack wait.
		return
	}
	switch {
	case IsPermanent(err):
		r.deadLetter(ctx, d, err.Error())
	case d.ev.Delivery >= uint64(r.cfg.MaxDeliver):
		r.deadLetter(ctx, d, fmt.Sprintf("gave up after %d deliveries: %v", d.ev.Delivery, err))
	default:
		delay, asked := retryDelay(err)
		if !asked {
			delay = r.backoff(d.ev.Delivery)
		}
		if nerr := d.msg.NakWithDelay(delay); nerr != nil {
			r.logger.Warn("nak", "event_id", d.ev.ID, "error", nerr)
		}
		r.obs.Retried(r.name, 1)
		r.logger.Warn("event failed, will retry", "event_id", d.ev.ID, "event_type", d.ev.Type,
			"delivery", d.ev.Delivery, "retry_in", delay, "error", err)
	}
}

// HandleOnce runs the subscriber's handler on one event outside the
// consumer, with the same checkpoint semantics (operators redriving a dead
// letter use it): an event already in the checkpoint is not handled again
// and handled is false.
func (r *Runner) HandleOnce(ctx context.Context, ev Event) (handled bool, err error) {
	if r.txH != nil {
		fresh, err := r.txBatch(ctx, []delivery{{ev: ev}})
		return fresh == 1, err
	}
	var done bool
	if err := r.opts.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM processed_events WHERE subscriber = $1 AND event_id = $2)`, r.name, ev.ID).Scan(&done); err != nil {
		return false, err
	}
	if done {
		return false, nil
	}
	if err := r.call(ctx, ev); err != nil {
		return false, err
	}
	_, err = r.opts.Pool.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`, r.name, ev.ID)
	return err == nil, err
}

// backoff is retry_min doubled per delivery so far, capped at retry_max.
func (r *Runner) backoff(delivery uint64) time.Duration {
	d := r.cfg.RetryMin
	for i := uint64(1); i < delivery && d < r.cfg.RetryMax; i++ {
		d *= 2
	}
	return min(d, r.cfg.RetryMax)
}
