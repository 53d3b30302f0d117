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
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	// DependencyDown reports that a dependency stopped answering: the
	// subscriber holds its events and takes no new ones.
	DependencyDown(subscriber, dependency string)
	// DependencyUp reports that a dependency answers (again, after down;
	// 0 when it is first known).
	DependencyUp(subscriber, dependency string, down time.Duration)
}

// NopObserver ignores everything.
type NopObserver struct{}

func (NopObserver) Handled(string, int, time.Duration)         {}
func (NopObserver) Skipped(string, int)                        {}
func (NopObserver) Retried(string, int)                        {}
func (NopObserver) DeadLettered(string, int)                   {}
func (NopObserver) DependencyDown(string, string)              {}
func (NopObserver) DependencyUp(string, string, time.Duration) {}

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
	// Sabotage is deliberately broken behaviour, for the fault run's
	// self-test only (it proves the checker catches it). Never set it in
	// production: only a binary built with the fanout_sabotage tag does.
	Sabotage Sabotage
}

// Sabotage breaks the runtime's guarantees on purpose.
type Sabotage struct {
	// AckBeforeCommit acks a TxHandler's batch before its transaction
	// commits, and waits this long in between: a crash in that window
	// loses the events.
	AckBeforeCommit time.Duration
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
	health  *health
	workers sync.WaitGroup
	loops   sync.WaitGroup
	// exclusive: a suspect (an event whose earlier attempt died with its
	// process) is handled with every other worker paused, so that a crash
	// it causes is charged to it alone.
	exclusive sync.RWMutex
	// crashed simulates the process dying (tests): from then on the runner
	// writes no bookkeeping, as a killed process would not.
	crashed atomic.Bool

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
	if err := r.checkStore(ctx); err != nil {
		return err
	}
	if err := jsretry.Do(ctx, r.logger, "provision the dead-letter stream", func() error {
		return ensureDeadLetterStream(ctx, r.js, r.cfg, r.opts.Stream.Replicas)
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
		cons, err = ensureConsumer(ctx, stream, ConsumerConfig(r.opts.Handler.Name(), r.opts.Handler.EventTypes(), r.cfg, r.opts.Stream), r.opts.Stream.Provision)
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

	hardCtx, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	softCtx, cancelSoft := context.WithCancel(hardCtx)
	r.cancelHard, r.cancelSoft = cancelHard, cancelSoft
	r.health = newHealth(hardCtx, r.name, r.logger, r.obs, r.dependencies())

	batches := make(chan []jetstream.Msg)
	r.loops.Add(2)
	go func() {
		defer r.loops.Done()
		r.dispatch(softCtx, hardCtx, batches)
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
				r.process(softCtx, hardCtx, batch)
			}
		}()
	}
	info := cons.CachedInfo()
	r.logger.Info("subscriber started", "consumer", info.Name, "filter_subjects", info.Config.FilterSubjects,
		"pending", info.NumPending, "concurrency", r.cfg.Concurrency, "batch_size", r.cfg.BatchSize,
		"max_failures", r.cfg.MaxFailures, "max_crashes", r.cfg.MaxCrashes)
	return nil
}

// dependencies are Postgres (the checkpoint, always) and what the handler
// declares.
func (r *Runner) dependencies() []Dependency {
	deps := []Dependency{{Name: DependencyPostgres, Probe: r.opts.Pool.Ping}}
	if dh, ok := r.opts.Handler.(DependentHandler); ok {
		deps = append(deps, dh.Dependencies()...)
	}
	// The dead-letter stream has no probe: after the backoff, the held dead
	// letter's own publish is the probe.
	return append(deps, Dependency{Name: DependencyDeadLetters})
}

// Names of the dependencies the runtime itself has.
const (
	DependencyPostgres    = "postgres"
	DependencyDeadLetters = "deadletter"
)

// Ready reports why this subscriber cannot do its work right now (a
// dependency it needs is down), or nil. Readiness probes use it.
func (r *Runner) Ready() error {
	if r.health == nil {
		return fmt.Errorf("subscriber %s: not started", r.name)
	}
	return r.health.ready()
}

// checkStore makes sure, at start, that the subscriber may write its own
// rows of processed_events and subscriber_attempts (in a transaction it
// rolls back). A missing grant or table is a configuration error to be told
// now, not an outage to be waited out forever; Postgres being unreachable is
// waited out (as long as ctx allows).
func (r *Runner) checkStore(ctx context.Context) error {
	wait := 100 * time.Millisecond
	for {
		err := pgx.BeginFunc(ctx, r.opts.Pool, func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO processed_events (subscriber, event_id) VALUES ($1, -1) ON CONFLICT DO NOTHING`, r.name)
			b.Queue(`INSERT INTO subscriber_attempts (subscriber, event_id) VALUES ($1, -1) ON CONFLICT DO NOTHING`, r.name)
			b.Queue(lookupAttemptsSQL, r.name, []int64{-1})
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			return errRollBack
		})
		if errors.Is(err, errRollBack) {
			return nil
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "42501" || pgErr.Code == "42P01") {
			return fmt.Errorf("subscriber %s cannot use its rows of processed_events and subscriber_attempts: %w "+
				"(run `fanout migrate`, then grant its role what deploy/postgres/roles.sql grants)", r.name, err)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("subscriber %s: check its checkpoint tables: %w", r.name, err)
		}
		r.logger.Warn("checkpoint store unavailable at start; waiting", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// errRollBack ends a transaction that only checked what it may do.
var errRollBack = errors.New("roll back")

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

// Stop drains: no new messages are pulled, the ones being handled finish
// and are acked, then it returns. Events held for an outage (a dependency
// is down) are let go at once, unacked: JetStream redelivers them after the
// ack wait, to this subscriber's other instances or its next start. If ctx
// ends first, the handlers' context is cancelled (their events are
// redelivered likewise) and Stop returns ctx's error. Stop is idempotent.
func (r *Runner) Stop(ctx context.Context) error {
	r.stopOnce.Do(func() {
		if r.cancelSoft == nil {
			return
		}
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
		r.health.wait()
		r.logger.Info("subscriber stopped")
	})
	return r.stopErr
}

// gatherWait is how long the dispatcher waits for more messages to fill a
// batch once it has one: short, so a lone event is not held back.
const gatherWait = 2 * time.Millisecond

// dispatch groups received messages into batches for the workers, until
// the iterator is drained or stopped. While a dependency is down it pulls
// nothing: the events in hand wait for it, and new ones would only wait too.
func (r *Runner) dispatch(softCtx, hardCtx context.Context, batches chan<- []jetstream.Msg) {
	defer close(batches)
	for {
		if !r.health.waitUp(softCtx) {
			return
		}
		msg, err := r.iter.Next(jetstream.NextContext(hardCtx))
		if err != nil {
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) || hardCtx.Err() != nil {
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
		case <-hardCtx.Done():
			return
		}
		if closed {
			return
		}
	}
}

// delivery is one received message and the event it carries, with what the
// runtime has learned about it so far.
type delivery struct {
	msg jetstream.Msg
	ev  Event
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
}

// msgs are the delivery's message and its duplicates'.
func (d *delivery) msgs() []jetstream.Msg {
	out := make([]jetstream.Msg, 0, 1+len(d.dups))
	out = append(out, d.msg)
	for _, dup := range d.dups {
		out = append(out, dup.msg)
	}
	return out
}

// result is what became of one delivery's attempt.
type result struct {
	kind  resultKind
	err   error
	delay time.Duration // for resultSnooze
}

type resultKind int

const (
	resultDone      resultKind = iota // effect and checkpoint committed, acked
	resultFailed                      // the handler failed on the event: counted
	resultPermanent                   // the handler says never: dead letter
	resultSnooze                      // RetryAfter: nak with its delay, not counted
	resultRetry                       // a connection broke or a transaction conflicted: nak, not counted
	resultOutage                      // a dependency is down: hold the event
	resultAbandoned                   // the runner stops: leave it unacked
)

// process takes a batch from delivery to its outcome. Events held by an
// outage stay in hand (kept alive with in-progress signals) and are tried
// again when every dependency answers; their deliveries cost them nothing.
func (r *Runner) process(softCtx, hardCtx context.Context, msgs []jetstream.Msg) {
	ds := make([]*delivery, 0, len(msgs))
	first := make(map[int64]*delivery, len(msgs))
	for _, m := range msgs {
		ev, err := r.parse(m)
		d := &delivery{msg: m, ev: ev}
		if err != nil {
			d.deadReason = err.Error()
		} else if p := first[ev.ID]; p != nil {
			// One attempt for the event; the copy shares its fate (a copy
			// acked as a duplicate while the first failed would lose the
			// event, if both are the same stream message).
			p.dups = append(p.dups, d)
			continue
		} else {
			first[ev.ID] = d
		}
		ds = append(ds, d)
	}
	stop := r.keepAlive(ds)
	defer stop()
	for len(ds) > 0 {
		if !r.health.waitUp(softCtx) {
			// Stopping during an outage: let the events go; another
			// instance (or the next start) gets them after the ack wait.
			r.closeAttempts(ds)
			return
		}
		ds = r.attempt(hardCtx, ds)
	}
}

// keepAlive tells JetStream the batch is still being worked on (or held
// for an outage), so it is not redelivered to another instance meanwhile.
func (r *Runner) keepAlive(ds []*delivery) (stop func()) {
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
					if !d.settled.Load() {
						for _, m := range d.msgs() {
							_ = m.InProgress()
						}
					}
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

// attempt tries the deliveries once and returns those held by an outage.
func (r *Runner) attempt(ctx context.Context, ds []*delivery) (held []*delivery) {
	var todo []*delivery
	for _, d := range ds {
		if d.deadReason == "" {
			todo = append(todo, d)
		} else if !r.deadLetter(ctx, d) {
			held = append(held, d)
		}
	}
	normal, suspects, waiting := r.triage(ctx, todo)
	held = append(held, waiting...)
	if len(normal) > 0 {
		held = append(held, r.attemptTogether(ctx, normal)...)
	}
	for _, d := range suspects {
		held = append(held, r.attemptSuspect(ctx, d)...)
	}
	return held
}

// triage sorts the deliveries by what the runtime knows of their events.
// First deliveries go straight to the handler. A redelivered event may be
// in the checkpoint already (acked and skipped), may have worn out its
// failures or crashes (dead letter: the process died after deciding so),
// may be a suspect (an earlier attempt never ended: handled alone), or else
// is handled with the others, under an attempt of its own.
func (r *Runner) triage(ctx context.Context, ds []*delivery) (normal, suspects, held []*delivery) {
	var redelivered []int64
	for _, d := range ds {
		if d.ev.Delivery > 1 {
			redelivered = append(redelivered, d.ev.ID)
		}
	}
	if len(redelivered) == 0 {
		return ds, nil, nil
	}
	states, err := r.lookupAttempts(ctx, redelivered)
	if err != nil {
		if ctx.Err() == nil {
			r.health.markDown(DependencyPostgres, err)
			return nil, nil, ds
		}
		r.closeAttempts(ds)
		return nil, nil, nil
	}
	var skipped []*delivery
	for _, d := range ds {
		if d.ev.Delivery <= 1 {
			normal = append(normal, d)
			continue
		}
		st := states[d.ev.ID]
		d.hasRow, d.mark = st.hasRow, true
		died := st.openAttempts
		if d.opened {
			died-- // this process's own attempt, held through an outage: not a death
		}
		switch {
		case st.done:
			skipped = append(skipped, d)
		case st.failures >= r.cfg.MaxFailures:
			d.deadReason = fmt.Sprintf("gave up after %d failures (subscribers.max_failures): %s", st.failures, st.lastError)
		case died >= r.cfg.MaxCrashes:
			d.deadReason = fmt.Sprintf("its handling never ended %d times: the process died each time (killed, out of memory, or a crash outside the handler), so it was not tried again (subscribers.max_crashes)", died)
		case died > 0:
			suspects = append(suspects, d)
		default:
			normal = append(normal, d)
		}
		if d.deadReason != "" && !r.deadLetter(ctx, d) {
			held = append(held, d)
		}
	}
	if len(skipped) > 0 {
		r.closeAttempts(skipped)
		r.ack(ctx, skipped, false)
		r.forgetAttempts(ctx, skipped)
		r.obs.Skipped(r.name, len(skipped))
	}
	return normal, suspects, held
}

// attemptTogether handles deliveries side by side with the other workers'.
// Their attempts are opened only once no suspect runs alone: a suspect's
// crash must not be charged to events that had not started.
func (r *Runner) attemptTogether(ctx context.Context, ds []*delivery) (held []*delivery) {
	r.exclusive.RLock()
	if err := r.openAttempts(ctx, ds); err != nil {
		r.exclusive.RUnlock()
		return r.heldBy(ctx, ds, err)
	}
	results := r.handle(ctx, ds)
	r.exclusive.RUnlock()
	return r.settle(ctx, ds, results)
}

// attemptSuspect handles one suspect alone, every other worker paused.
func (r *Runner) attemptSuspect(ctx context.Context, d *delivery) (held []*delivery) {
	r.exclusive.Lock()
	defer r.exclusive.Unlock()
	one := []*delivery{d}
	if err := r.openAttempts(ctx, one); err != nil {
		return r.heldBy(ctx, one, err)
	}
	r.logger.Warn("handling an event alone: an earlier attempt on it never ended (its process died)", "event_id", d.ev.ID, "event_type", d.ev.Type, "delivery", d.ev.Delivery)
	return r.settle(ctx, one, r.handle(ctx, one))
}

// heldBy returns the deliveries held for a failed bookkeeping write: the
// checkpoint store is down (or the runner stops, and they are let go).
func (r *Runner) heldBy(ctx context.Context, ds []*delivery, err error) []*delivery {
	if ctx.Err() != nil {
		r.closeAttempts(ds)
		return nil
	}
	r.health.markDown(DependencyPostgres, err)
	return ds
}

// handle runs the handler on the deliveries and records the successes.
func (r *Runner) handle(ctx context.Context, ds []*delivery) []result {
	if r.txH != nil {
		return r.handleTx(ctx, ds)
	}
	return r.handleEach(ctx, ds)
}

// judge classifies a failed attempt. A dependency that is down is never
// the event's fault: if the handler did not name one (Unavailable), the
// dependencies are probed before the failure is charged to the event.
func (r *Runner) judge(ctx context.Context, err error) result {
	if ctx.Err() != nil {
		return result{kind: resultAbandoned, err: err}
	}
	if IsPermanent(err) {
		return result{kind: resultPermanent, err: err}
	}
	if dep, ok := IsUnavailable(err); ok {
		r.health.markDown(dep, err)
		return result{kind: resultOutage, err: err}
	}
	if delay, ok := retryDelay(err); ok {
		return result{kind: resultSnooze, err: err, delay: delay}
	}
	if r.health.probeAll(ctx) {
		return result{kind: resultOutage, err: err}
	}
	if connectivity(err) || conflict(err) {
		return result{kind: resultRetry, err: err}
	}
	return result{kind: resultFailed, err: err}
}

// settle gives each failed delivery its fate and returns those held.
func (r *Runner) settle(ctx context.Context, ds []*delivery, results []result) (held []*delivery) {
	// Attempts close before any nak: a redelivery that found its event's
	// attempt still open would take it for a crash.
	var closing []*delivery
	for i, d := range ds {
		switch results[i].kind {
		case resultSnooze, resultRetry, resultOutage, resultAbandoned:
			closing = append(closing, d)
		}
	}
	closed := r.closeAttempts(closing)
	for i, d := range ds {
		res := results[i]
		switch res.kind {
		case resultDone:
		case resultPermanent:
			d.deadReason = res.err.Error()
			if !r.deadLetter(ctx, d) {
				held = append(held, d)
			}
		case resultFailed:
			failures, err := r.recordFailure(ctx, d, res.err)
			if err != nil {
				// The failure cannot be counted: the store is down.
				held = append(held, r.heldBy(ctx, []*delivery{d}, err)...)
				continue
			}
			if failures >= r.cfg.MaxFailures {
				d.deadReason = fmt.Sprintf("gave up after %d failures (subscribers.max_failures): %v", failures, res.err)
				if !r.deadLetter(ctx, d) {
					held = append(held, d)
				}
				continue
			}
			delay := r.backoff(uint64(failures))
			r.nak(d, delay)
			r.logger.Warn("event failed, will retry", "event_id", d.ev.ID, "event_type", d.ev.Type,
				"failures", failures, "max_failures", r.cfg.MaxFailures, "retry_in", delay, "error", res.err)
		case resultSnooze, resultRetry:
			if !closed {
				// Naked with its attempt open, it would come back as a
				// suspect: wait for the store, then try again.
				held = append(held, r.heldBy(ctx, []*delivery{d}, errors.New("close the attempt: the checkpoint store does not answer"))...)
				continue
			}
			delay := res.delay
			if res.kind == resultRetry {
				delay = r.backoff(d.ev.Delivery)
				r.logger.Warn("event failed on a broken connection or a conflict with another transaction; retrying without counting it against the event",
					"event_id", d.ev.ID, "event_type", d.ev.Type, "retry_in", delay, "error", res.err)
			}
			r.nak(d, delay)
		case resultOutage:
			held = append(held, d)
		case resultAbandoned:
			// Hard stop: the failure is ours, not the event's. Left
			// unacked, it is redelivered after the ack wait.
		}
	}
	return held
}

func (r *Runner) nak(d *delivery, delay time.Duration) {
	for _, m := range d.msgs() {
		if err := m.NakWithDelay(delay); err != nil {
			r.logger.Warn("nak", "event_id", d.ev.ID, "error", err)
		}
	}
	d.settled.Store(true)
	r.obs.Retried(r.name, 1)
}

// handleTx handles a batch in one transaction with its checkpoint rows; if
// the batch fails for anything but an outage, it rolls back and each event
// is handled alone, so one bad event never holds up the others.
func (r *Runner) handleTx(ctx context.Context, ds []*delivery) []result {
	results := make([]result, len(ds))
	start := time.Now()
	fresh, err := r.txBatch(ctx, ds)
	if err == nil {
		r.succeeded(ctx, ds, fresh, start)
		return results
	}
	verdict := r.judge(ctx, err)
	if len(ds) == 1 || verdict.kind == resultOutage || verdict.kind == resultAbandoned {
		for i := range results {
			results[i] = verdict
		}
		return results
	}
	r.logger.Debug("batch failed, handling its events one by one", "events", len(ds), "error", err)
	for i, d := range ds {
		one := []*delivery{d}
		fresh, err := r.txBatch(ctx, one)
		if err != nil {
			results[i] = r.judge(ctx, err)
			if k := results[i].kind; k == resultOutage || k == resultAbandoned {
				for j := i + 1; j < len(ds); j++ {
					results[j] = results[i]
				}
				break
			}
			continue
		}
		r.succeeded(ctx, one, fresh, time.Now())
	}
	return results
}

// txBatch runs the handler on the batch's new events in one transaction and
// returns how many were new.
func (r *Runner) txBatch(ctx context.Context, ds []*delivery) (fresh int, err error) {
	ids := eventIDs(ds)
	forget := rowIDs(ds)
	// A hung handler must not hold its events forever (the in-progress
	// signals would keep them from being redelivered): bound the attempt.
	actx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout)
	defer cancel()
	tx, err := r.opts.Pool.Begin(actx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	fresh, err = r.inTx(actx, tx, ds, ids, forget)
	if err == nil {
		if r.opts.Sabotage.AckBeforeCommit > 0 {
			r.ack(ctx, ds, false)
			time.Sleep(r.opts.Sabotage.AckBeforeCommit)
		}
		err = tx.Commit(actx)
	}
	err = r.timedOut(ctx, actx, err)
	var ee *eventError
	if errors.As(err, &ee) {
		err = ee.err
	}
	if err != nil {
		return 0, err
	}
	return fresh, nil
}

func (r *Runner) inTx(ctx context.Context, tx pgx.Tx, ds []*delivery, ids, forget []int64) (fresh int, err error) {
	rows, err := tx.Query(ctx, checkpointSQL, r.name, ids)
	if err != nil {
		return 0, fmt.Errorf("checkpoint: %w", err)
	}
	newIDs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return 0, fmt.Errorf("checkpoint: %w", err)
	}
	todo := make(map[int64]bool, len(newIDs))
	for _, id := range newIDs {
		todo[id] = true
	}
	var evs []Event
	for _, d := range ds {
		if todo[d.ev.ID] {
			delete(todo, d.ev.ID) // a duplicate in the same batch runs once
			evs = append(evs, d.ev)
		}
	}
	if bh, ok := r.txH.(BatchTxHandler); ok && len(evs) > 1 {
		if err := r.callBatchTx(ctx, bh, tx, evs); err != nil {
			return 0, fmt.Errorf("batch of %d events: %w", len(evs), err)
		}
	} else {
		for _, ev := range evs {
			if err := r.callTx(ctx, tx, ev); err != nil {
				return 0, &eventError{id: ev.ID, err: err}
			}
		}
	}
	if len(forget) > 0 {
		if _, err := tx.Exec(ctx, forgetAttemptsSQL, r.name, forget); err != nil {
			return 0, fmt.Errorf("forget attempts: %w", err)
		}
	}
	return len(newIDs), nil
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
func (r *Runner) callEach(ctx context.Context, ds []*delivery) []error {
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
			sctx, span := r.batchContext(hctx, evs)
			defer span.End()
			got := bh.HandleBatch(sctx, evs)
			for i := range got {
				got[i] = r.timedOut(ctx, hctx, got[i])
			}
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
	hctx, cancel := context.WithTimeout(ctx, r.cfg.HandlerTimeout) // see txBatch
	defer cancel()
	hctx, span := r.eventContext(hctx, ev)
	defer span.End()
	return r.timedOut(ctx, hctx, r.eventH.Handle(hctx, ev))
}

// timedOut says so when a handler's error comes from its own deadline
// (subscribers.handler_timeout) rather than from a stop.
func (r *Runner) timedOut(ctx, hctx context.Context, err error) error {
	if err != nil && ctx.Err() == nil && errors.Is(hctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("handler did not finish within subscribers.handler_timeout (%s): %w", r.cfg.HandlerTimeout, err)
	}
	return err
}

func recoverHandler(ev Event, err *error) {
	if p := recover(); p != nil {
		*err = fmt.Errorf("handler panicked on event %d: %v\n%s", ev.ID, p, debug.Stack())
	}
}

// handleEach handles the batch's events (their effects are outside
// Postgres), then checkpoints the ones that succeeded.
func (r *Runner) handleEach(ctx context.Context, ds []*delivery) []result {
	start := time.Now()
	results := make([]result, len(ds))
	done, err := r.processed(ctx, eventIDs(ds))
	if err != nil {
		verdict := result{kind: resultAbandoned, err: err}
		if ctx.Err() == nil {
			r.health.markDown(DependencyPostgres, err)
			verdict.kind = resultOutage
		}
		for i := range results {
			results[i] = verdict
		}
		return results
	}
	seen := make(map[int64]bool, len(ds))
	for _, id := range done {
		seen[id] = true
	}
	var ok, todo, skipped []*delivery
	var todoAt []int
	for i, d := range ds {
		if seen[d.ev.ID] {
			ok = append(ok, d)
			skipped = append(skipped, d)
			continue
		}
		todo = append(todo, d)
		todoAt = append(todoAt, i)
	}
	errs := r.callEach(ctx, todo)
	if _, batched := r.eventH.(BatchEventHandler); batched && sameFailure(errs) && r.judge(ctx, errs[0]).kind == resultFailed {
		// A batch handler that failed as a whole may have failed on one of
		// its events: each is tried alone, so that one bad event is not
		// charged to all of them (as handleTx does).
		r.logger.Debug("batch failed as a whole, handling its events one by one", "events", len(todo), "error", errs[0])
		for j, d := range todo {
			errs[j] = r.call(ctx, d.ev)
		}
	}
	var handled []*delivery
	for j, d := range todo {
		if errs[j] != nil {
			results[todoAt[j]] = r.judge(ctx, errs[j])
			continue
		}
		ok = append(ok, d)
		handled = append(handled, d)
	}
	if len(handled) > 0 || len(skipped) > 0 {
		if err := r.checkpoint(ctx, handled, rowIDs(ok)); err != nil {
			// The effects happened; held, the (idempotent) handler runs
			// again once Postgres answers, and the checkpoint follows.
			if ctx.Err() == nil {
				r.health.markDown(DependencyPostgres, err)
			}
			for i, d := range ds {
				if slices.Contains(ok, d) {
					results[i] = result{kind: resultOutage, err: err}
					if ctx.Err() != nil {
						results[i].kind = resultAbandoned
					}
				}
			}
			return results
		}
	}
	r.beforeAck(ctx, ok)
	if ctx.Err() != nil {
		for i, d := range ds {
			if slices.Contains(ok, d) {
				results[i] = result{kind: resultAbandoned}
			}
		}
		return results // hard stop: the events come back after the ack wait
	}
	r.ack(ctx, ok, false)
	if len(handled) > 0 {
		r.health.handlerWorked()
	}
	r.obs.Handled(r.name, len(handled), time.Since(start))
	r.logger.Debug("batch handled", "events", len(handled), "skipped", len(skipped), "redelivered", redelivered(ds), "took", time.Since(start))
	if len(skipped) > 0 {
		r.obs.Skipped(r.name, len(skipped))
	}
	return results
}

// processed returns the ids among ids already in the checkpoint.
func (r *Runner) processed(ctx context.Context, ids []int64) ([]int64, error) {
	ctx, cancel := r.bookkeeping(ctx)
	defer cancel()
	rows, err := r.opts.Pool.Query(ctx, processedSQL, r.name, ids)
	if err != nil {
		return nil, fmt.Errorf("read the checkpoint: %w", err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("read the checkpoint: %w", err)
	}
	return done, nil
}

// sameFailure reports whether a batch of more than one event failed as a
// whole: every event with the same error, and not an outage.
func sameFailure(errs []error) bool {
	if len(errs) < 2 || errs[0] == nil {
		return false
	}
	if _, down := IsUnavailable(errs[0]); down || IsPermanent(errs[0]) {
		return false
	}
	for _, err := range errs[1:] {
		if err == nil || err.Error() != errs[0].Error() {
			return false
		}
	}
	return true
}

// checkpoint records handled events and forgets the attempts of every
// event done with, in one round trip (a batch runs as one implicit
// transaction).
func (r *Runner) checkpoint(ctx context.Context, handled []*delivery, forget []int64) error {
	ctx, cancel := r.bookkeeping(ctx)
	defer cancel()
	ids := eventIDs(handled)
	b := &pgx.Batch{}
	if len(ids) > 0 {
		b.Queue(`
INSERT INTO processed_events (subscriber, event_id)
SELECT $1, id FROM unnest($2::bigint[]) AS id
ON CONFLICT DO NOTHING`, r.name, ids)
	}
	if len(forget) > 0 {
		b.Queue(forgetAttemptsSQL, r.name, forget)
	}
	if b.Len() == 0 {
		return nil
	}
	return r.opts.Pool.SendBatch(ctx, b).Close()
}

// succeeded acks a committed batch (double ack: the server confirms, so a
// lost ack cannot make JetStream redeliver behind our back unnoticed).
func (r *Runner) succeeded(ctx context.Context, ds []*delivery, fresh int, start time.Time) {
	r.beforeAck(ctx, ds)
	if ctx.Err() != nil {
		return // hard stop: the events come back after the ack wait, and are skipped
	}
	if r.opts.Sabotage.AckBeforeCommit == 0 {
		r.ack(ctx, ds, true)
	}
	r.health.handlerWorked()
	r.obs.Handled(r.name, fresh, time.Since(start))
	r.logger.Debug("batch handled", "events", fresh, "skipped", len(ds)-fresh, "redelivered", redelivered(ds), "first_event_id", ds[0].ev.ID, "took", time.Since(start))
	if skipped := len(ds) - fresh; skipped > 0 {
		r.obs.Skipped(r.name, skipped)
	}
}

// redelivered counts the deliveries that were not an event's first.
func redelivered(ds []*delivery) int {
	n := 0
	for _, d := range ds {
		if d.ev.Delivery > 1 {
			n++
		}
	}
	return n
}

func (r *Runner) beforeAck(ctx context.Context, ds []*delivery) {
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

func (r *Runner) ack(ctx context.Context, ds []*delivery, double bool) {
	defer func() {
		for _, d := range ds {
			d.settled.Store(true)
		}
	}()
	if !double {
		for _, d := range ds {
			for _, m := range d.msgs() {
				if err := m.Ack(); err != nil {
					r.logger.Warn("ack", "event_id", d.ev.ID, "error", err)
				}
			}
		}
		return
	}
	g, gctx := errgroup.WithContext(context.WithoutCancel(ctx))
	g.SetLimit(ackParallelism)
	for _, d := range ds {
		for _, m := range d.msgs() {
			g.Go(func() error {
				actx, cancel := context.WithTimeout(gctx, 5*time.Second)
				defer cancel()
				if err := m.DoubleAck(actx); err != nil {
					// The effect is committed with its checkpoint: a
					// redelivery will be skipped.
					r.logger.Warn("double ack", "event_id", d.ev.ID, "error", err)
				}
				return nil
			})
		}
	}
	_ = g.Wait()
}

// HandleOnce runs the subscriber's handler on one event outside the
// consumer, with the same checkpoint semantics (operators redriving a dead
// letter use it): an event already in the checkpoint is not handled again
// and handled is false.
func (r *Runner) HandleOnce(ctx context.Context, ev Event) (handled bool, err error) {
	d := &delivery{ev: ev, hasRow: true}
	if r.txH != nil {
		fresh, err := r.txBatch(ctx, []*delivery{d})
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
	err = r.checkpoint(ctx, []*delivery{d}, []int64{ev.ID})
	return err == nil, err
}

// backoff is retry_min doubled per failure (or delivery) after the first,
// capped at retry_max.
func (r *Runner) backoff(n uint64) time.Duration {
	d := r.cfg.RetryMin
	for i := uint64(1); i < n && d < r.cfg.RetryMax; i++ {
		d *= 2
	}
	return min(d, r.cfg.RetryMax)
}
