package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/semaphore"
)

// Observer is told what the relay does; metrics implement it. Its methods
// are called from several goroutines and must not block.
type Observer interface {
	// Claimed reports a claimed batch of n rows and how long the claim took.
	Claimed(n int, took time.Duration)
	// Published reports rows whose PubAck arrived and were marked sent.
	Published(events []Published)
	// Retried reports rows returned to pending after a failed publish.
	Retried(n int)
	// Failed reports rows marked failed, which will never be published.
	Failed(n int)
	// Reaped reports rows whose lease expired, returned to pending.
	Reaped(n int)
	// Deleted reports sent rows of outbox_default deleted after their
	// retention (rows no range of the outbox holds).
	Deleted(n int)
	// OutboxRanges reports, after each retention pass, how many ranges
	// (partitions) the outbox holds and how many the pass dropped.
	OutboxRanges(held, dropped int)
	// SlotLag reports, in wal capture, how far the replication slot's
	// confirmed position is behind the server's WAL, and for how long it
	// has been behind without moving (0 when it is not behind).
	SlotLag(bytes int64, stuck time.Duration)
	// ConfigDifferences reports, after each check of the stream, how many
	// of object's settings differ from fanout's configuration.
	ConfigDifferences(object string, n int)
	// Rewound reports a restore that rewound the outbox's ids (origin.go).
	Rewound()
	// Audited reports an audit of the stream against the outbox
	// (audit.go): events checked, found missing, and published again.
	Audited(kind string, checked, missing, repaired int)
	// AtomicBatch reports an atomic batch of events (atomic.go): stored
	// whole, or refused or unanswered (err) and its events published again
	// another way or later.
	AtomicBatch(events int, err error)
}

// Published describes one row stored in the stream.
type Published struct {
	ID        int64
	CreatedAt time.Time // when the writer's transaction inserted the row
	AckedAt   time.Time // when its PubAck arrived
	Duplicate bool      // JetStream already had it (an earlier publish of this row)
}

// NopObserver ignores everything.
type NopObserver struct{}

func (NopObserver) Claimed(int, time.Duration)    {}
func (NopObserver) Published([]Published)         {}
func (NopObserver) Retried(int)                   {}
func (NopObserver) Failed(int)                    {}
func (NopObserver) Reaped(int)                    {}
func (NopObserver) Deleted(int)                   {}
func (NopObserver) OutboxRanges(int, int)         {}
func (NopObserver) SlotLag(int64, time.Duration)  {}
func (NopObserver) ConfigDifferences(string, int) {}
func (NopObserver) Rewound()                      {}
func (NopObserver) Audited(string, int, int, int) {}
func (NopObserver) AtomicBatch(int, error)        {}

// Options are the relay's collaborators.
type Options struct {
	Relay    Config
	Stream   stream.Config
	Pool     *pgxpool.Pool
	Conn     *nats.Conn
	Logger   *slog.Logger
	Observer Observer // optional
}

// Relay publishes outbox rows. Start it with Start, stop it with Stop.
type Relay struct {
	cfg    Config
	stream stream.Config
	pool   *pgxpool.Pool
	store  *outbox.Store
	nc     *nats.Conn
	js     jetstream.JetStream
	logger *slog.Logger
	obs    Observer

	hooks testhooks.Relay // zero but in tests (internal/testhooks)

	// order keeps each aggregate's events in order through the wal
	// relay's concurrent publishes.
	order *aggregateOrder

	wake  chan struct{}
	slots *semaphore.Weighted // rows claimed and not yet recorded
	// atomicOK: the live stream allows atomic batches (checkStream);
	// atomicSlots bounds those open at once (atomic.go).
	atomicOK    atomic.Bool
	atomicSlots *semaphore.Weighted
	batches     sync.WaitGroup // deliveries in flight
	loops       sync.WaitGroup // claimer, listener, reaper, cleaner

	// lastClaimed (unix nanoseconds) is when a claim last completed, empty
	// or not, and lastClaimErr the error of the last one that failed:
	// readiness reads them, with no query of its own.
	lastClaimed  atomic.Int64
	unrecorded   atomic.Int64 // rows claimed and handed to deliveries, not yet recorded
	lastClaimErr atomic.Pointer[string]
	floor        claimFloor          // where most claims start (claim.go)
	heads        heads               // the claim loop's walk round the aggregates (claim.go)
	analyzedAt   time.Time           // when the claim loop last asked for the ranges' statistics (analyzeBurst)
	sweptHeads   outbox.AggregateKey // where the sweeper's walk round the aggregates goes on (sweepHeads)
	txChunks     txChunks            // the big transactions' chunks published (relay.atomic transaction, txclaim.go)

	// wal capture (see walstream.go).
	captureState   atomic.Int32  // captureConnecting, captureStandby, captureStreaming
	confirmedLSN   atomic.Uint64 // the last position confirmed to the server
	confirmedAt    atomic.Int64  // unix nanoseconds of the last confirm over a transaction
	backlogThrough atomic.Int64  // the slot's backlog bound, -1 until known
	backlogDone    atomic.Bool   // every row up to the bound was published
	slot           atomic.Pointer[SlotState]
	slotCheckEvery time.Duration // slotCheckInterval; tests shorten it
	// partitionsAhead is how many empty ranges the outbox keeps beyond
	// the next id (defaultPartitionsAhead); tests with small ranges raise it.
	partitionsAhead int
	partitionMargin int64 // see maxPartitionMargin; tests lower it
	visibility      *visibilityGate
	// drift is what the live stream's settings differ in from the
	// configuration, as of the last check (readiness reads it).
	drift *stream.Drift
	// identity is the database's identity and its outbox's epochs, which
	// every message carries (origin.go).
	identity atomic.Pointer[outbox.Identity]
	// originWant is bumped to ask for a rewind check before the next
	// publish, originDone is the request the last check answered;
	// pgStarted is the Postgres start time last seen (unix nanoseconds).
	// foreign stops publishing into a stream another database owns,
	// conflict while the stream holds an epoch the outbox does not know.
	originWant, originDone atomic.Uint64
	pgStarted              atomic.Int64
	foreign                atomic.Bool
	conflict               atomic.Pointer[string]
	rewindMu               sync.Mutex
	// auditConsumer is the consumer the audit reads runs of consumerRead
	// sequences or more through (AuditConsumer; fanout audit's is
	// AuditCommandConsumer).
	auditConsumer string
	consumerRead  uint64
	// auditLease checks, while this relay audits, that it still holds the
	// audit lock (a long pass checks it between windows).
	auditLease func(context.Context) error

	startOnce  sync.Once
	stopOnce   sync.Once
	stopping   chan struct{}      // closed by Stop: claim no more
	cancelSoft context.CancelFunc // stops the background loops
	cancelHard context.CancelFunc // aborts deliveries in flight
	stopErr    error

	// testHookBeforeRecord, when set, runs after the PubAcks of a batch
	// arrived and before the batch is recorded in Postgres.
	testHookBeforeRecord func(ctx context.Context, ids []int64)
	// testTxWindow, when set, is the transaction claim's window (claimWindow).
	testTxWindow int
	// testSweepWindow, when set, replaces sweepWindow (tests walk a
	// backlog below the floor in windows of a few rows).
	testSweepWindow int
	// testHookBeforeConfirm, when set, runs in wal capture after every row
	// of a transaction has its PubAck and before the slot may be confirmed
	// past it.
	testHookBeforeConfirm func(ctx context.Context, end pglogrepl.LSN)
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
	r := &Relay{
		cfg:         opts.Relay,
		stream:      opts.Stream,
		pool:        opts.Pool,
		store:       outbox.NewStore(opts.Pool),
		nc:          opts.Conn,
		js:          js,
		logger:      opts.Logger,
		obs:         obs,
		order:       newAggregateOrder(),
		wake:        make(chan struct{}, 1),
		slots:       semaphore.NewWeighted(int64(opts.Relay.MaxInFlight)),
		atomicSlots: semaphore.NewWeighted(atomicInFlight),
		stopping:    make(chan struct{}),
	}
	r.store.OnFailed = outbox.OnFailed(r.cfg.OnFailed)
	r.partitionsAhead = defaultPartitionsAhead
	r.partitionMargin = min(max(r.cfg.PartitionSize, minPartitionMargin), maxPartitionMargin)
	r.backlogThrough.Store(-1)
	r.slotCheckEvery = slotCheckInterval
	r.visibility = &visibilityGate{pool: opts.Pool}
	r.drift = stream.NewDrift(opts.Logger, obs.ConfigDifferences)
	r.auditConsumer, r.consumerRead = AuditConsumer, consumerRead
	if opts.Stream.Databases == stream.SeveralDatabases {
		// Each database's auditor would take the other's consumer: a
		// shared stream is read by direct gets only.
		r.auditConsumer = ""
	}
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
	if err := r.loadIdentity(ctx); err != nil {
		return err
	}
	if r.stream.Database == "" {
		// The owner a stream this relay makes records.
		r.stream.Database = r.identity.Load().Database.String()
	}
	if r.stream.Provision == "auto" {
		if err := jsretry.Do(ctx, r.logger, "check the stream's owner", func() error {
			return r.claimUnowned(ctx)
		}); err != nil {
			return err
		}
	}
	if err := jsretry.Do(ctx, r.logger, "provision the stream", func() error {
		return stream.Ensure(ctx, r.js, r.stream, RepublishDelay(r.cfg), r.logger)
	}); err != nil {
		return err
	}
	if err := r.checkOwner(ctx); err != nil {
		return err
	}
	r.markOriginStale()
	hardCtx, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	softCtx, cancelSoft := context.WithCancel(hardCtx)
	r.cancelHard, r.cancelSoft = cancelHard, cancelSoft
	r.lastClaimed.Store(time.Now().UnixNano())
	if r.stream.Provision != "off" {
		r.checkStream(ctx)
		r.loops.Add(1)
		go func() {
			defer r.loops.Done()
			stream.Watch(softCtx, r.stream.CheckInterval, func(ctx context.Context) {
				r.checkStream(ctx)
				r.originCheck(ctx)
			})
		}()
	}

	wal := r.cfg.Capture == CaptureWAL
	if wal {
		r.loops.Add(2)
		go func() {
			defer r.loops.Done()
			r.walLoop(softCtx, hardCtx)
		}()
		go func() {
			defer r.loops.Done()
			r.slotLoop(softCtx)
		}()
	} else {
		// One claim loop: a claim is one backend updating a batch of
		// rows, and the loop claims again as soon as the batch is handed
		// to the publisher, so publishing never waits for a claim.
		r.loops.Add(1)
		go func() {
			defer r.loops.Done()
			if r.cfg.Atomic == AtomicTransaction {
				r.txClaimLoop(softCtx, hardCtx)
				return
			}
			r.claimLoop(softCtx, hardCtx)
		}()
	}
	if r.cfg.Listen && !wal {
		r.loops.Add(1)
		go func() {
			defer r.loops.Done()
			r.listen(softCtx)
		}()
	}
	r.loops.Add(2)
	go func() {
		defer r.loops.Done()
		r.reapLoop(softCtx)
	}()
	go func() {
		defer r.loops.Done()
		r.cleanupLoop(softCtx)
	}()
	if r.cfg.Audit && !r.hooks.NoAudit {
		r.loops.Add(1)
		go func() {
			defer r.loops.Done()
			r.auditLoop(softCtx)
		}()
	}
	if wal {
		r.logger.Info("relay started", "capture", r.cfg.Capture, "slot", r.cfg.Slot, "publication", Publication,
			"stream", r.stream.Name, "subjects", r.stream.SubjectPrefix+".>",
			"batch_size", r.cfg.BatchSize, "max_in_flight", r.cfg.MaxInFlight)
	} else {
		r.logger.Info("relay started", "capture", r.cfg.Capture,
			"stream", r.stream.Name, "subjects", r.stream.SubjectPrefix+".>",
			"batch_size", r.cfg.BatchSize, "max_in_flight", r.cfg.MaxInFlight,
			"lease", r.cfg.Lease, "poll_interval", r.cfg.PollInterval, "listen", r.cfg.Listen)
	}
	return nil
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
	if r.atomicOK.Swap(live.AllowAtomicPublish) != live.AllowAtomicPublish && !live.AllowAtomicPublish {
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
	if err := r.originErr(); err != nil {
		return err
	}
	if r.cfg.Capture == CaptureWAL {
		return r.walReady()
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
func (r *Relay) Nudge() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// sleep waits for d, a wake-up or a stop; it returns false on stop.
func (r *Relay) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.wake:
		return true
	case <-r.stopping:
		return false
	case <-ctx.Done():
		return false
	}
}
