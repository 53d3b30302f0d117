package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/fanout/fanout/events"
	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/semaphore"
)

// Options are the relay's collaborators.
type Options struct {
	Relay    Config
	Stream   stream.Config
	Pool     *pgxpool.Pool
	Conn     *nats.Conn
	Logger   *slog.Logger
	Observer Observer // optional
	// EventTypes, if set, are the declared event types: a row whose
	// payload breaks its type's schema is marked failed with the reason
	// (relay.undeclared_events says what becomes of an undeclared type).
	EventTypes *events.Catalog
}

// Relay publishes outbox rows. Start it with Start, stop it with Stop.
//
// The relay owns the lifecycle and the claim loop of poll capture; each
// other capability is a part of its own, which it starts and stops: the
// publisher (publish.go, atomic.go) and the delivery (deliver.go) every
// capture shares, the sweeper (sweep.go), the transaction delivery
// (txclaim.go), the wal capture (walstream.go and the wal*.go files), the
// auditor (audit.go), the maintainer (maintain.go) and the wake-up
// listener (listen.go). They share the relay's core (core.go).
type Relay struct {
	*core
	publisher  *publisher
	delivery   *delivery
	sweeper    *sweeper
	tx         *txDelivery
	wal        *walCapture
	auditor    *auditor
	maintainer *maintainer
	listener   *listener
	stats      *rangeStats
	consumers  *consumerGuard

	floor claimFloor // where most claims start (claim.go)
	heads heads      // the claim loop's walk round the aggregates (claim.go)
	// drift is what the live stream's settings differ in from the
	// configuration, as of the last check (readiness reads it).
	drift *stream.Drift

	startOnce  sync.Once
	stopOnce   sync.Once
	cancelSoft context.CancelFunc // stops the background loops
	cancelHard context.CancelFunc // aborts deliveries in flight
	stopErr    error
}

// New returns a relay; nothing runs until Start.
func New(opts Options) (*Relay, error) {
	// A relay embedded in another program may not have gone through the
	// binary's configuration: the settings are checked here, by the rules
	// of their own package (the defaults are DefaultConfig's).
	if err := opts.Relay.Validate(); err != nil {
		return nil, err
	}
	js, err := jetstream.New(opts.Conn,
		jetstream.WithPublishAsyncMaxPending(opts.Relay.MaxInFlight),
		jetstream.WithPublishAsyncTimeout(opts.Relay.PublishTimeout),
	)
	if err != nil {
		return nil, fmt.Errorf("jetstream context: %w", err)
	}
	obs := opts.Observer
	if obs == nil {
		obs = NopObserver{}
	}
	c := &core{
		cfg:      opts.Relay,
		stream:   opts.Stream,
		pool:     opts.Pool,
		store:    outboxstore.New(opts.Pool),
		nc:       opts.Conn,
		js:       js,
		logger:   opts.Logger,
		obs:      obs,
		wake:     make(chan struct{}, 1),
		stopping: make(chan struct{}),
		slots:    semaphore.NewWeighted(int64(opts.Relay.MaxInFlight)),
	}
	c.store.OnFailed = outboxstore.OnFailed(c.cfg.OnFailed)
	c.origin = &originGuard{core: c}
	r := &Relay{core: c, drift: stream.NewDrift(opts.Logger, obs.ConfigDifferences)}
	r.publisher = newPublisher(c, events.Checker{Types: opts.EventTypes, AllowUndeclared: opts.Relay.UndeclaredEvents != UndeclaredFail})
	r.delivery = &delivery{core: c, pub: r.publisher}
	r.stats = &rangeStats{core: c, floor: &r.floor}
	r.sweeper = &sweeper{core: c, delivery: r.delivery, floor: &r.floor}
	r.tx = &txDelivery{core: c, pub: r.publisher, delivery: r.delivery, stats: r.stats}
	r.wal = newWALCapture(c, r.publisher, r.delivery, r.tx)
	r.tx.wal = r.wal
	r.auditor = newAuditor(c)
	r.maintainer = newMaintainer(c, r.wal)
	r.listener = &listener{core: c}
	r.consumers = newConsumerGuard(c.js, c.stream, r.drift, c.logger)
	return r, nil
}

// Start provisions or verifies the stream (per stream.provision), then starts
// claiming. It returns once the relay runs; ctx bounds the start only.
func (r *Relay) Start(ctx context.Context) error {
	err := errors.New("relay already started")
	r.startOnce.Do(func() {
		err = r.start(ctx)
	})
	return err
}

func (r *Relay) start(ctx context.Context) error {
	r.hooks = testhooks.RelayFrom(ctx)
	r.store.Unordered = r.hooks.Unordered
	if err := r.origin.load(ctx); err != nil {
		return err
	}
	if r.stream.Database == "" {
		// The owner a stream this relay makes records.
		r.stream.Database = r.origin.identity.Load().Database.String()
	}
	if r.stream.Provision == "auto" {
		if err := jsretry.Do(ctx, r.logger, "check the stream's owner", func() error {
			return r.origin.claimUnowned(ctx)
		}); err != nil {
			return err
		}
	}
	if err := jsretry.Do(ctx, r.logger, "provision the stream", func() error {
		return stream.Ensure(ctx, r.js, r.stream, RepublishDelay(r.cfg), r.logger)
	}); err != nil {
		return err
	}
	if err := r.origin.checkOwner(ctx); err != nil {
		return err
	}
	r.origin.markStale()
	hardCtx, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	softCtx, cancelSoft := context.WithCancel(hardCtx)
	r.cancelHard, r.cancelSoft = cancelHard, cancelSoft
	r.touch()
	if r.stream.Provision != "off" {
		r.checkStream(ctx)
		r.consumers.check(ctx)
		r.loops.Go(func() {
			stream.Watch(softCtx, r.stream.CheckInterval, func(ctx context.Context) {
				r.checkStream(ctx)
				r.consumers.check(ctx)
				r.origin.recheck(ctx)
			})
		})
	}

	wal := r.cfg.Capture == CaptureWAL
	switch {
	case wal:
		r.loops.Go(func() { r.wal.run(softCtx, hardCtx) })
		r.loops.Go(func() { r.wal.watchSlot(softCtx) })
	case r.cfg.Atomic == AtomicTransaction:
		// One claim loop: a claim is one backend updating a batch of
		// rows, and the loop claims again as soon as the batch is handed
		// to the publisher, so publishing never waits for a claim.
		r.loops.Go(func() { r.tx.run(softCtx, hardCtx) })
	default:
		r.loops.Go(func() { r.claimEvents(softCtx, hardCtx) })
	}
	if r.cfg.Listen && !wal {
		r.loops.Go(func() { r.listener.run(softCtx) })
	}
	r.loops.Go(func() { r.maintainer.reap(softCtx) })
	r.loops.Go(func() { r.maintainer.cleanup(softCtx) })
	if r.cfg.Audit && !r.hooks.NoAudit {
		r.loops.Go(func() { r.auditor.run(softCtx) })
	}
	r.logStarted()
	return nil
}

// logStarted says the relay runs, and with what, naming the database as
// its events' origins name it: what another database's operators register
// (fanout outbox allow-origin).
func (r *Relay) logStarted() {
	database := ""
	if ident := r.origin.identity.Load(); ident != nil {
		database = ident.Database.String()
	}
	if r.cfg.Capture == CaptureWAL {
		r.logger.Info("relay started", "database", database, "capture", r.cfg.Capture, "slot", r.cfg.Slot, "publication", Publication,
			"stream", r.stream.Name, "subjects", r.stream.SubjectPrefix+".>",
			"batch_size", r.cfg.BatchSize, "max_in_flight", r.cfg.MaxInFlight)
	} else {
		r.logger.Info("relay started", "database", database, "capture", r.cfg.Capture,
			"stream", r.stream.Name, "subjects", r.stream.SubjectPrefix+".>",
			"batch_size", r.cfg.BatchSize, "max_in_flight", r.cfg.MaxInFlight,
			"lease", r.cfg.Lease, "poll_interval", r.cfg.PollInterval, "listen", r.cfg.Listen)
	}
}

// checkStream compares the live stream with the configuration.
func (r *Relay) checkStream(ctx context.Context) {
	s, err := r.js.Stream(ctx, r.stream.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		r.drift.Set("stream "+r.stream.Name, stream.Missing)
		return
	}
	if err != nil {
		r.logger.Debug("stream check: no answer", "stream", r.stream.Name, "error", err)
		return
	}
	live := s.CachedInfo().Config
	r.drift.Set("stream "+r.stream.Name, stream.StreamDifferences(live, stream.JetStreamConfig(r.stream)))
	if r.publisher.atomicOK.Swap(live.AllowAtomicPublish) != live.AllowAtomicPublish && !live.AllowAtomicPublish {
		r.logger.Warn("the stream does not allow atomic batches: an aggregate's events waiting behind one another go a round trip each (`fanout provision --update-stream "+r.stream.Name+"` sets allow_atomic)", "stream", r.stream.Name)
	}
}

// Stop claims no more rows, lets the batches in flight finish (their PubAcks
// arrive and they are marked), and returns. If ctx ends first, the batches
// are abandoned: their rows stay `sending` until the reaper returns them, and
// Stop returns ctx's error. Stop is idempotent.
func (r *Relay) Stop(ctx context.Context) error {
	r.stopOnce.Do(func() {
		close(r.stopping)
		if r.cancelSoft == nil { // never started
			return
		}
		r.cancelSoft()
		done := make(chan struct{})
		go func() {
			r.loops.Wait()
			r.batches.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-ctx.Done():
			r.stopErr = fmt.Errorf("relay stop: batches still in flight: %w", ctx.Err())
			r.cancelHard()
			<-done
		}
		r.cancelHard()
		r.logger.Info("relay stopped")
	})
	return r.stopErr
}

// Ready reports why this relay cannot do its work, or nil: it has not
// completed a claim for relay.stall_after (Postgres unreachable, claims
// failing, NATS disconnected, or every slot in flight waiting on PubAcks
// that do not come). It reads the relay's own state and queries nothing:
// an old row in the table (one backing off after failed publishes, say) is
// no reason to take a working relay out of rotation.
func (r *Relay) Ready() error {
	select {
	case <-r.stopping:
		return errors.New("relay stopping")
	default:
	}
	if r.cancelSoft == nil {
		return errors.New("relay not started")
	}
	if err := r.drift.Err(); err != nil {
		return err
	}
	if err := r.origin.blocked(); err != nil {
		return err
	}
	if r.cfg.Capture == CaptureWAL {
		return r.wal.ready()
	}
	since := time.Since(time.Unix(0, r.lastClaimed.Load()))
	if since <= r.cfg.StallAfter {
		return nil
	}
	why := ""
	if !r.nc.IsConnected() {
		why = "; NATS is not connected, and claims wait for it"
	}
	if last := r.lastClaimErr.Load(); last != nil {
		why += "; last claim error: " + *last
	}
	return fmt.Errorf("relay stalled: no claim completed for %s (relay.stall_after is %s)%s", since.Round(time.Second), r.cfg.StallAfter, why)
}

// Nudge wakes the claimer, as a writer's notification does.
func (r *Relay) Nudge() { r.nudge() }

// Slot returns the last state read of a wal relay's slot (nil before the
// first read, in poll capture, or when the slot does not exist).
func (r *Relay) Slot() *SlotState { return r.wal.slot.Load() }
