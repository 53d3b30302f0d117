package subscribers

// The runner: its options, its life (start, readiness, stop).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Options are a runner's collaborators.
type Options struct {
	// Declaration is the subscriber: the runner takes its name, its event
	// types and whether it is ordered from here.
	Declaration Declaration
	// Handler is the declaration's handler, built (Declaration.Build).
	Handler  Handler
	Config   Config
	Stream   stream.Config
	Pool     *pgxpool.Pool
	Conn     *nats.Conn
	Logger   *slog.Logger
	Observer Observer // optional
}

// Runner runs one subscriber: its consumer, its workers, its dead letters.
type Runner struct {
	opts    Options
	store   bookkeeping.Store    // the subscribers' tables, on opts.Pool
	origins *originKeys          // checkpoint keys of events' identities (origin.go)
	hooks   testhooks.Subscriber // zero but in tests (internal/testhooks)
	name    string
	ordered bool
	eventH  EventHandler
	txH     TxHandler
	cfg     Config
	logger  *slog.Logger
	obs     Observer
	js      jetstream.JetStream
	stream  jetstream.Stream
	cons    jetstream.Consumer
	iter    jetstream.MessagesContext
	health  *Health
	stall   stallWatch
	// drift is what the live streams and the consumer differ in from the
	// configuration, as of the last check (readiness reads it).
	drift *stream.Drift
	// unnumberedRead lists, as of watchNumbering's last look, the event
	// types an ordered subscriber reads that the outbox does not number.
	unnumberedRead atomic.Pointer[string]
	workers        sync.WaitGroup
	loops          sync.WaitGroup
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

// New checks the declaration and its handler and returns a runner;
// nothing runs until Start.
func New(opts Options) (*Runner, error) {
	d, h := opts.Declaration, opts.Handler
	if h.IsZero() {
		return nil, errors.New("subscriber: no handler (make one with subscribers.Tx or subscribers.Each)")
	}
	if !stream.ValidSubjectToken(d.Name) || strings.ContainsAny(d.Name, `/\`) {
		return nil, fmt.Errorf("subscriber name %q: must be one subject token (letters, digits, '-', '_')", d.Name)
	}
	if len(d.EventTypes) == 0 {
		return nil, fmt.Errorf("subscriber %s: no event types", d.Name)
	}
	if err := d.runs(h); err != nil {
		return nil, err
	}
	r := &Runner{opts: opts, store: bookkeeping.New(opts.Pool), name: d.Name, ordered: d.Ordered, cfg: opts.Config, obs: opts.Observer}
	r.logger = opts.Logger.With("subscriber", d.Name)
	if r.obs == nil {
		r.obs = NopObserver{}
	}
	r.drift = stream.NewDrift(r.logger, func(object string, n int) { r.obs.ConfigDifferences(r.name, object, n) })
	// The handler's kind was chosen where it was made (Tx or Each).
	r.txH, r.eventH = h.tx, h.each
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
	r.hooks = testhooks.SubscriberFrom(ctx)
	if err := r.checkStore(ctx); err != nil {
		return err
	}
	if err := jsretry.Do(ctx, r.logger, "provision the dead-letter stream", func() error {
		return ensureDeadLetterStream(ctx, r.js, r.cfg, r.opts.Stream.Replicas, r.logger)
	}); err != nil {
		return err
	}
	events, err := r.waitForStream(ctx)
	if err != nil {
		return fmt.Errorf("subscriber %s: stream %s: %w", r.name, r.opts.Stream.Name, err)
	}
	r.stream = events
	want := ConsumerConfig(r.name, r.opts.Declaration.EventTypes, r.ordered, r.cfg, r.opts.Stream)
	if want.DeliverPolicy != jetstream.DeliverAllPolicy {
		if err := r.startFromFirstIfNotNew(ctx, &want); err != nil {
			return err
		}
	}
	var cons jetstream.Consumer
	err = jsretry.Do(ctx, r.logger, "provision the consumer", func() error {
		var err error
		cons, err = ensureConsumer(ctx, events, want, r.opts.Stream.Provision)
		return err
	})
	if err != nil {
		return fmt.Errorf("subscriber %s: %w", r.name, err)
	}
	r.cons = cons
	// A small buffer: a draining instance finishes what it holds, so what
	// it holds should be little.
	pull := []jetstream.PullMessagesOpt{jetstream.PullMaxMessages(r.cfg.BatchSize * r.cfg.Concurrency)}
	if r.ordered {
		// The pinned instance keeps its pin by pulling well within
		// pinned_ttl, even when idle.
		pull = append(pull, jetstream.PullPriorityGroup(orderedGroup), jetstream.PullExpiry(r.cfg.PinnedTTL/3))
	}
	iter, err := cons.Messages(pull...)
	if err != nil {
		return fmt.Errorf("subscriber %s: consume: %w", r.name, err)
	}
	r.iter = iter

	hardCtx, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	softCtx, cancelSoft := context.WithCancel(hardCtx)
	r.cancelHard, r.cancelSoft = cancelHard, cancelSoft
	r.health = NewHealth(hardCtx, r.name, r.logger, r.obs, r.dependencies())

	batches := make(chan received)
	// An ordered subscriber's dispatcher learns what became of each batch.
	inOrder := r.ordered && !r.hooks.Unordered
	var finished chan []*delivery
	if inOrder {
		finished = make(chan []*delivery, r.cfg.Concurrency)
	}
	if r.opts.Stream.Provision != "off" {
		r.checkConfig(ctx)
		r.loops.Add(1)
		go func() {
			defer r.loops.Done()
			stream.Watch(softCtx, r.opts.Stream.CheckInterval, r.checkConfig)
		}()
	}
	if r.ordered {
		r.loops.Add(1)
		go func() {
			defer r.loops.Done()
			stream.Watch(softCtx, r.opts.Stream.CheckInterval, r.watchNumbering)
		}()
	}
	r.stall.finished() // the clock starts now
	if r.cfg.StallAfter > 0 {
		r.obs.Stalled(r.name, false)
		r.loops.Add(1)
		go func() {
			defer r.loops.Done()
			r.watchdogLoop(softCtx)
		}()
	}
	r.loops.Add(2)
	go func() {
		defer r.loops.Done()
		if inOrder {
			r.dispatchOrdered(hardCtx, batches, finished)
		} else {
			r.dispatch(softCtx, hardCtx, batches)
		}
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
				ds := r.process(softCtx, hardCtx, batch)
				if finished != nil {
					select {
					case finished <- ds:
					case <-hardCtx.Done():
					}
				}
			}
		}()
	}
	info := cons.CachedInfo()
	r.logger.Info("subscriber started", "consumer", info.Name, "filter_subjects", info.Config.FilterSubjects,
		"pending", info.NumPending, "concurrency", r.cfg.Concurrency, "batch_size", r.cfg.BatchSize,
		"max_failures", r.cfg.MaxFailures, "max_crashes", r.cfg.MaxCrashes, "ordered", r.ordered)
	return nil
}

// dependencies are Postgres (the checkpoint, always) and what the handler
// declares.
func (r *Runner) dependencies() []Dependency {
	deps := append([]Dependency{{Name: DependencyPostgres, Probe: r.opts.Pool.Ping}}, r.opts.Handler.Dependencies()...)
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
// dependency it needs is down, or it is stalled: events wait and it has
// finished none for subscribers.stall_after), or nil. Readiness probes use
// it.
func (r *Runner) Ready() error {
	if r.health == nil {
		return fmt.Errorf("subscriber %s: not started", r.name)
	}
	if err := r.health.ready(); err != nil {
		return err
	}
	if err := r.drift.Err(); err != nil {
		return fmt.Errorf("subscriber %s: %w", r.name, err)
	}
	if p := r.unnumberedRead.Load(); p != nil && *p != "" {
		return fmt.Errorf("subscriber %s is ordered, and the outbox does not number %s, which it reads (fanout outbox numbering)", r.name, *p)
	}
	return r.stall.err()
}

// checkConfig compares the live streams and the subscriber's consumer with
// the configuration. A check that gets no answer changes nothing.
func (r *Runner) checkConfig(ctx context.Context) {
	want := map[string]jetstream.StreamConfig{r.opts.Stream.Name: stream.JetStreamConfig(r.opts.Stream)}
	if r.cfg.DeadLetterProvision != "off" {
		want[r.cfg.DeadLetterStream] = DeadLetterStreamConfig(r.cfg, r.opts.Stream.Replicas)
	}
	for name, sc := range want {
		s, err := r.js.Stream(ctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			r.drift.Set("stream "+name, stream.Missing)
			continue
		}
		if err != nil {
			r.logger.Debug("stream check: no answer", "stream", name, "error", err)
			continue
		}
		r.drift.Set("stream "+name, stream.StreamDifferences(s.CachedInfo().Config, sc))
	}
	object := "consumer " + r.name
	c, err := r.stream.Consumer(ctx, r.name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		r.drift.Set(object, stream.Missing)
		return
	}
	if err != nil {
		r.logger.Debug("consumer check: no answer", "consumer", r.name, "error", err)
		return
	}
	info := c.CachedInfo()
	ds := ConsumerDifferences(info.Config, ConsumerConfig(r.name, r.opts.Declaration.EventTypes, r.ordered, r.cfg, r.opts.Stream))
	// A consumer made again since this subscriber bound it may start
	// anywhere (its start position is not compared): say so until a
	// restart binds the new one.
	if bound := r.cons.CachedInfo().Created; !info.Created.Equal(bound) {
		ds = append(ds, stream.Difference{Field: "created", Have: info.Created.UTC().Format(time.RFC3339Nano), Want: bound.UTC().Format(time.RFC3339Nano) + " (the consumer this subscriber bound at start: it was deleted and made again since, and may start elsewhere)"})
	}
	r.drift.Set(object, ds)
}

// startFromFirstIfNotNew makes a consumer created for a subscriber that
// already has checkpoints start at the stream's first event, whatever
// subscribers.start says: its consumer is being made again (deleted by
// hand, or lost with a JetStream store rolled back), and starting at new
// events would skip every event published while it was gone. Its
// checkpoints absorb the events it had handled.
func (r *Runner) startFromFirstIfNotNew(ctx context.Context, want *jetstream.ConsumerConfig) error {
	var seen bool
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		var err error
		seen, err = r.store.CheckpointAny(ctx, r.name)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("subscriber %s: read its checkpoint: %w", r.name, err)
		}
		r.logger.Warn("checkpoint store unavailable at start; waiting", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	if seen {
		r.logger.Info("subscribers.start applies to a new subscriber only: this one has checkpoints, so a consumer made now starts at the stream's first event",
			"start", r.cfg.Start)
		want.DeliverPolicy, want.OptStartTime = jetstream.DeliverAllPolicy, nil
	}
	return nil
}

// checkStore makes sure, at start, that the subscriber may write its own
// rows of processed_events, subscriber_attempts and dead_letters (in a
// transaction it rolls back). A missing grant or table is a configuration
// error to be told now, not an outage to be waited out forever; Postgres
// being unreachable is waited out (as long as ctx allows).
func (r *Runner) checkStore(ctx context.Context) error {
	wait := 100 * time.Millisecond
	for {
		err := pgx.BeginFunc(ctx, r.opts.Pool, func(tx pgx.Tx) error {
			db, err := outbox.ReadDatabase(ctx, tx)
			if err != nil {
				return err
			}
			r.origins = newOriginKeys(r.store, db)
			if r.ordered {
				if err := r.checkNumbered(ctx, tx); err != nil {
					return err
				}
			}
			if err := bookkeeping.New(tx).AccessCheck(ctx, bookkeeping.AccessCheckParams{Subscriber: r.name}); err != nil {
				return err
			}
			return errRollBack
		})
		if errors.Is(err, errRollBack) {
			return nil
		}
		if refused := (refusedStart{}); errors.As(err, &refused) {
			return refused.error
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "42501" || pgErr.Code == "42P01" || pgErr.Code == "42883") {
			return fmt.Errorf("subscriber %s cannot use its rows of processed_events, subscriber_attempts and dead_letters, or event_origins: %w "+
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

// checkNumbered refuses an ordered subscriber that reads an event type
// the outbox does not number (outboxstore.Store.SetNumbering): its events would
// come with no number and in no order.
func (r *Runner) checkNumbered(ctx context.Context, tx pgx.Tx) error {
	skipped, err := outbox.Unnumbered(ctx, tx)
	if errors.Is(err, outbox.ErrNoNumbering) {
		return refusedStart{fmt.Errorf("subscriber %s is ordered: %w", r.name, err)}
	}
	if err != nil {
		return err // checkStore judges it: Postgres unreachable is waited out
	}
	if read := r.readUnnumbered(skipped); len(read) > 0 {
		return refusedStart{fmt.Errorf("subscriber %s is ordered, but the outbox does not number %s, which it reads: "+
			"number them again (fanout outbox numbering, with --skip not naming them)", r.name, strings.Join(read, ", "))}
	}
	return nil
}

// readUnnumbered returns the types of skipped (the outbox does not number
// them) that the subscriber reads, by name or by a pattern.
func (r *Runner) readUnnumbered(skipped []string) []string {
	var read []string
	for _, t := range skipped {
		if slices.ContainsFunc(r.opts.Declaration.EventTypes, func(p string) bool { return SubjectMatches(p, t) }) {
			read = append(read, t)
		}
	}
	return read
}

// watchNumbering looks again, while an ordered subscriber runs, at the
// event types the outbox does not number (checkNumbered looked at start):
// one it reads, skipped since (by a fanout binary that does not know this
// subscriber), comes with no number and in no order. The subscriber then
// reports not ready and logs an error, until the type is numbered again.
func (r *Runner) watchNumbering(ctx context.Context) {
	skipped, err := outbox.Unnumbered(ctx, r.opts.Pool)
	if err != nil {
		r.logger.Debug("numbering check: no answer", "error", err)
		return
	}
	read := strings.Join(r.readUnnumbered(skipped), ", ")
	var was string
	if p := r.unnumberedRead.Swap(&read); p != nil {
		was = *p
	}
	switch {
	case read != "" && read != was:
		r.logger.Error("the outbox no longer numbers event types this ordered subscriber reads: their events come with no number, in no order; this subscriber reports not ready until they are numbered again (fanout outbox numbering)",
			"event_types", read)
	case read == "" && was != "":
		r.logger.Info("the outbox numbers every event type this ordered subscriber reads again", "event_types", was)
	}
}

// refusedStart is a start's error that waiting does not mend.
type refusedStart struct{ error }

func (e refusedStart) Unwrap() error { return e.error }

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
		r.health.Wait()
		if c, ok := r.opts.Handler.Unwrap().(io.Closer); ok {
			if err := c.Close(); err != nil {
				r.logger.Warn("close the handler", "error", err)
			}
		}
		r.logger.Info("subscriber stopped")
	})
	return r.stopErr
}
