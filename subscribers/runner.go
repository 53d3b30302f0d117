package subscribers

// The runner: its options, its life (start, readiness, stop).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
// It starts and stops its parts, each a type of its own: the handler's
// calls (call.go), the attempts' bookkeeping (attempts.go), the dead
// letters (deadletter.go), an ordered subscriber's checkpoint
// (orderedcheckpoint.go), the dependency breakers (health.go), the stall
// watchdog (watchdog.go), the checks while it runs (checks.go), the
// pruner (checkpoint.go) and the replays it carries out (replays.go).
type Runner struct {
	opts    Options
	name    string
	ordered bool
	cfg     Config
	hooks   testhooks.Subscriber // zero but in tests (internal/testhooks)
	logger  *slog.Logger
	obs     Observer

	store      bookkeeping.Store // the subscribers' tables, on opts.Pool
	call       caller
	origins    *originKeys // checkpoint keys of events' identities (origin.go)
	attempts   *attempts
	aggregates *aggregates
	dead       *deadLetters
	stall      stallWatch
	config     *configWatch
	share      *deadLetterShare // nil without subscribers.dead_letter_api_prefix
	replays    *replayer
	numbering  *numbering
	pruner     *pruner
	health     *Health // from the start

	js   jetstream.JetStream
	cons jetstream.Consumer
	feed *feed // the consumer's messages, each with its connection (feed.go)

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
	js, err := jetstream.New(opts.Conn)
	if err != nil {
		return nil, err
	}
	r := &Runner{opts: opts, name: d.Name, ordered: d.Ordered, cfg: opts.Config, obs: opts.Observer, js: js, store: bookkeeping.New(opts.Pool)}
	r.logger = opts.Logger.With("subscriber", d.Name)
	if r.obs == nil {
		r.obs = NopObserver{}
	}
	// The handler's kind was chosen where it was made (Tx or Each).
	r.call = caller{name: r.name, txH: h.tx, eventH: h.each, timeout: r.cfg.HandlerTimeout}
	r.origins = newOriginKeys(r.store, opts.Pool, r.cfg.HandlerTimeout)
	r.attempts = &attempts{store: r.store, name: r.name, timeout: r.cfg.HandlerTimeout, logger: r.logger, crashed: &r.crashed}
	r.aggregates = &aggregates{name: r.name, store: r.store, origins: r.origins, cfg: r.cfg}
	r.stall = stallWatch{name: r.name, after: r.cfg.StallAfter, logger: r.logger, obs: r.obs}
	r.dead = &deadLetters{name: r.name, cfg: r.cfg, subjectPrefix: opts.Stream.SubjectPrefix, js: js, conn: opts.Conn, store: r.store,
		attempts: r.attempts, stall: &r.stall, obs: r.obs, logger: r.logger}
	if r.ordered {
		r.dead.aggregates = r.aggregates
	}
	r.config = &configWatch{name: r.name, eventTypes: d.EventTypes, ordered: r.ordered, cfg: r.cfg, streamCfg: opts.Stream, js: js, logger: r.logger,
		drift: stream.NewDrift(r.logger, func(object string, n int) { r.obs.ConfigDifferences(r.name, object, n) })}
	r.numbering = &numbering{name: r.name, eventTypes: d.EventTypes, pool: opts.Pool, logger: r.logger}
	r.pruner = &pruner{store: r.store, name: r.name, maxAge: opts.Stream.MaxAge, logger: r.logger}
	r.replays = &replayer{name: r.name, streamName: opts.Stream.Name, pool: opts.Pool, js: js, logger: r.logger}
	if p := r.cfg.DeadLetterAPIPrefix; p != "" {
		if r.share, err = newDeadLetterShare(opts.Conn, p, r.name, r.obs, r.logger); err != nil {
			return nil, err
		}
	}
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
	if err := r.bind(ctx); err != nil {
		return err
	}
	hardCtx, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	softCtx, cancelSoft := context.WithCancel(hardCtx)
	r.cancelHard, r.cancelSoft = cancelHard, cancelSoft
	r.health = NewHealth(hardCtx, r.name, r.logger, r.obs, r.dependencies())
	r.dead.health, r.stall.health, r.stall.cons = r.health, r.health, r.cons
	r.run(ctx, softCtx, hardCtx)
	info := r.cons.CachedInfo()
	r.logger.Info("subscriber started", "consumer", info.Name, "filter_subjects", info.Config.FilterSubjects,
		"pending", info.NumPending, "concurrency", r.cfg.Concurrency, "batch_size", r.cfg.BatchSize,
		"max_failures", r.cfg.MaxFailures, "max_crashes", r.cfg.MaxCrashes, "ordered", r.ordered)
	return nil
}

// bind provisions (per stream.provision) or binds the subscriber's
// consumer on the events stream, and opens its messages.
func (r *Runner) bind(ctx context.Context) error {
	events, err := r.waitForStream(ctx)
	if err != nil {
		return fmt.Errorf("subscriber %s: stream %s: %w", r.name, r.opts.Stream.Name, err)
	}
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
	r.cons, r.config.events, r.config.bound = cons, events, cons
	// A small buffer: a draining instance finishes what it holds, so what
	// it holds should be little.
	pull := []jetstream.PullMessagesOpt{jetstream.PullMaxMessages(r.cfg.BatchSize * r.cfg.Concurrency)}
	if r.ordered {
		// The pinned instance keeps its pin by pulling well within
		// pinned_ttl, even when idle.
		pull = append(pull, jetstream.PullPriorityGroup(orderedGroup), jetstream.PullExpiry(r.cfg.pinnedTTL()/3))
	}
	if r.feed, err = openFeed(cons, r.opts.Conn, pull); err != nil {
		return fmt.Errorf("subscriber %s: consume: %w", r.name, err)
	}
	return nil
}

// run starts the runner's loops and workers: the dispatcher and the
// workers it feeds stop with hardCtx (after draining, at a soft stop), the
// watchers with softCtx.
func (r *Runner) run(ctx, softCtx, hardCtx context.Context) {
	batches := make(chan received)
	// An ordered subscriber's dispatcher learns what became of each batch.
	inOrder := r.ordered && !r.hooks.Unordered
	var finished chan []*delivery
	if inOrder {
		finished = make(chan []*delivery, r.cfg.Concurrency)
	}
	if r.opts.Stream.Provision != "off" {
		r.config.check(ctx)
		r.loops.Go(func() { stream.Watch(softCtx, r.opts.Stream.CheckInterval, r.config.check) })
	}
	if r.ordered {
		r.loops.Go(func() { stream.Watch(softCtx, r.opts.Stream.CheckInterval, r.numbering.watch) })
	}
	if r.share != nil {
		r.share.check(ctx)
		r.loops.Go(func() { stream.Watch(softCtx, r.opts.Stream.CheckInterval, r.share.check) })
	}
	r.stall.finished() // the clock starts now
	if r.cfg.StallAfter > 0 {
		r.obs.Stalled(r.name, false)
		r.loops.Go(func() { r.stall.loop(softCtx) })
	}
	r.loops.Go(func() {
		if inOrder {
			dispatchOrdered(r, hardCtx, batches, finished)
		} else {
			r.dispatch(softCtx, hardCtx, batches)
		}
	})
	r.loops.Go(func() { r.pruner.loop(softCtx) })
	r.loops.Go(func() { r.replays.loop(softCtx) })
	for range r.cfg.Concurrency {
		r.workers.Go(func() {
			for batch := range batches {
				ds := r.process(softCtx, hardCtx, batch)
				if finished != nil {
					select {
					case finished <- ds:
					case <-hardCtx.Done():
					}
				}
			}
		})
	}
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
	if err := r.config.drift.Err(); err != nil {
		return fmt.Errorf("subscriber %s: %w", r.name, err)
	}
	if err := r.numbering.err(); err != nil {
		return err
	}
	return r.stall.err()
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
			r.origins.setDatabase(db)
			if r.ordered {
				if err := r.numbering.check(ctx, tx); err != nil {
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
			return fmt.Errorf("subscriber %s cannot use its rows of processed_events, subscriber_attempts and dead_letters, event_origins, or take its replays: %w "+
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
		r.feed.drain()
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
			r.feed.stop()
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
