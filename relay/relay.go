package relay

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"
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

func (NopObserver) Claimed(int, time.Duration)   {}
func (NopObserver) Published([]Published)        {}
func (NopObserver) Retried(int)                  {}
func (NopObserver) Failed(int)                   {}
func (NopObserver) Reaped(int)                   {}
func (NopObserver) Deleted(int)                  {}
func (NopObserver) OutboxRanges(int, int)        {}
func (NopObserver) SlotLag(int64, time.Duration) {}

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

	wake    chan struct{}
	slots   *semaphore.Weighted // rows claimed and not yet recorded
	batches sync.WaitGroup      // deliveries in flight
	loops   sync.WaitGroup      // claimer, listener, reaper, cleaner

	// lastClaimed (unix nanoseconds) is when a claim last completed, empty
	// or not, and lastClaimErr the error of the last one that failed:
	// readiness reads them, with no query of its own.
	lastClaimed  atomic.Int64
	lastClaimErr atomic.Pointer[string]
	floor        claimFloor          // where most claims start (claim.go)
	heads        heads               // the claim loop's walk round the aggregates (claim.go)
	sweptHeads   outbox.AggregateKey // where the sweeper's walk round the aggregates goes on (sweepHeads)

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

	startOnce  sync.Once
	stopOnce   sync.Once
	stopping   chan struct{}      // closed by Stop: claim no more
	cancelSoft context.CancelFunc // stops the background loops
	cancelHard context.CancelFunc // aborts deliveries in flight
	stopErr    error

	// testHookBeforeRecord, when set, runs after the PubAcks of a batch
	// arrived and before the batch is recorded in Postgres.
	testHookBeforeRecord func(ctx context.Context, ids []int64)
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
	// config.Validate refuses this too; a relay embedded in another program
	// may not have gone through it. Below a batch, the claimer waits for
	// room that never comes and the relay publishes nothing.
	if opts.Relay.Capture == "" {
		opts.Relay.Capture = CapturePoll
	}
	if opts.Relay.Slot == "" {
		opts.Relay.Slot = DefaultSlot
	}
	if opts.Relay.MaxInFlight < opts.Relay.BatchSize {
		return nil, fmt.Errorf("relay.max_in_flight (%d) must be at least relay.batch_size (%d): the relay claims a batch only when all of it fits in flight, so it would never publish",
			opts.Relay.MaxInFlight, opts.Relay.BatchSize)
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
		cfg:      opts.Relay,
		stream:   opts.Stream,
		pool:     opts.Pool,
		store:    outbox.NewStore(opts.Pool),
		nc:       opts.Conn,
		js:       js,
		logger:   opts.Logger,
		obs:      obs,
		order:    newAggregateOrder(),
		wake:     make(chan struct{}, 1),
		slots:    semaphore.NewWeighted(int64(opts.Relay.MaxInFlight)),
		stopping: make(chan struct{}),
	}
	r.store.OnFailed = outbox.OnFailed(r.cfg.OnFailed)
	if r.cfg.PartitionSize == 0 {
		r.cfg.PartitionSize = DefaultPartitionSize
	}
	r.partitionsAhead = defaultPartitionsAhead
	r.partitionMargin = min(max(r.cfg.PartitionSize, minPartitionMargin), maxPartitionMargin)
	r.backlogThrough.Store(-1)
	r.slotCheckEvery = slotCheckInterval
	r.visibility = &visibilityGate{pool: opts.Pool}
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
	if err := jsretry.Do(ctx, r.logger, "provision the stream", func() error {
		return stream.Ensure(ctx, r.js, r.stream, RepublishDelay(r.cfg), r.logger)
	}); err != nil {
		return err
	}
	hardCtx, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	softCtx, cancelSoft := context.WithCancel(hardCtx)
	r.cancelHard, r.cancelSoft = cancelHard, cancelSoft
	r.lastClaimed.Store(time.Now().UnixNano())

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

// eagerPollMin is the first wait after a claim that found nothing; it
// doubles up to the poll interval.
const eagerPollMin = time.Millisecond

func (r *Relay) claimLoop(softCtx, hardCtx context.Context) {
	// After wal capture, rows its relays published are still pending:
	// they must be told apart before the first claim (handover.go).
	if !r.waitHandover(softCtx, hardCtx) {
		return
	}
	r.loops.Add(1)
	go func() {
		defer r.loops.Done()
		r.sweepLoop(softCtx, hardCtx)
	}()
	idle := eagerPollMin
	errWait := eagerPollMin
	batch := int64(r.cfg.BatchSize)
	for {
		select {
		case <-r.stopping:
			return
		default:
		}
		if !r.nc.IsConnected() {
			// Claiming now would only burn attempts; rows wait as pending.
			if !r.sleep(softCtx, r.cfg.PollInterval) {
				return
			}
			continue
		}
		if err := r.slots.Acquire(softCtx, batch); err != nil {
			return
		}
		// The claim runs on hardCtx: cancelling it after the server committed
		// would strand the claimed rows until their lease expires.
		start := time.Now()
		rows, token, backlog, err := r.claim(hardCtx)
		if err != nil {
			msg := err.Error()
			r.lastClaimErr.Store(&msg)
			r.slots.Release(batch)
			r.logger.Error("claim outbox batch", "error", err, "retry_in", errWait)
			if !r.sleep(softCtx, errWait) {
				return
			}
			errWait = min(errWait*2, max(r.cfg.PollInterval, time.Second))
			continue
		}
		errWait = eagerPollMin
		r.lastClaimed.Store(time.Now().UnixNano())
		r.slots.Release(batch - int64(len(rows)))
		if len(rows) == 0 {
			if !r.sleep(softCtx, idle) {
				return
			}
			idle = min(idle*2, r.cfg.PollInterval)
			continue
		}
		r.obs.Claimed(len(rows), time.Since(start))
		idle = eagerPollMin
		r.deliverAsync(hardCtx, rows, token, backlog)
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

// row is one claimed outbox row.
type row = outbox.Claimed

// outcome of one row's publish.
type outcome struct {
	acked     bool
	duplicate bool
	ackedAt   time.Time
	permanent bool // never publishable: mark failed
	returned  bool // not published: an earlier event of its aggregate in the batch was not
	err       string
}

func newLeaseToken() pgtype.UUID {
	var u pgtype.UUID
	_, _ = rand.Read(u.Bytes[:]) // crypto/rand.Read never fails
	u.Valid = true
	return u
}

// claimNextDepth is how many events of one aggregate a relay claims at
// once after publishing one (ClaimNext): published a wave at a time, they
// cost one record and one claim between them.
const claimNextDepth = 8

// deliver publishes a claimed batch and records the outcomes. Rows of
// one aggregate go a wave at a time (publishWaves). Then, with claimNext,
// it claims the next events of each aggregate it published and delivers
// those the same way: the claim takes an aggregate's next event only once
// the one before is published (outbox's claimSQL), and the claim loop
// starts above a floor that such an event, written long ago, may be below
// (claimFloor), so without this an aggregate's backlog would move one
// event per sweep. held is how many of the relay's slots the delivery
// holds: it takes more (if free, up to claimNextDepth per aggregate) for
// the next events, and its caller releases them all at the end.
func (r *Relay) deliver(ctx context.Context, rows []row, token pgtype.UUID, claimNext bool, held *int64) {
	for len(rows) > 0 {
		results, ok := r.publishWaves(ctx, rows)
		if !ok {
			// Hard stop: leave the rows `sending`; the reaper returns them.
			return
		}
		if r.testHookBeforeRecord != nil {
			ids := make([]int64, len(rows))
			for i := range rows {
				ids[i] = rows[i].ID
			}
			r.testHookBeforeRecord(ctx, ids)
		}
		next, rest := r.nextClaim(rows, results, claimNext, held)
		start := time.Now()
		claimed, ok := r.record(ctx, rows, token, results, next)
		if !ok {
			return
		}
		// The other aggregates go on beside this delivery, once their
		// events are recorded (ClaimNext takes no more than the next ones).
		for _, chunk := range rest {
			r.continueAsync(ctx, chunk)
		}
		if next == nil {
			return
		}
		if len(claimed) > 0 {
			r.obs.Claimed(len(claimed), time.Since(start))
		}
		rows, token = claimed, next.Token
	}
}

// nextClaim is the claim of the next events of the aggregates a delivery
// published (rows and their results), made with its record: for a batch's
// worth of aggregates (it takes the slots it can for them, up to
// claimNextDepth each); the others, in chunks of a batch's worth, go on
// in deliveries of their own (continueAsync), so that a busy backlog
// keeps several batches in flight, as the claim loop does. It is nil when
// there is nothing to go on with or the relay is stopping.
func (r *Relay) nextClaim(rows []row, results []outcome, claimNext bool, held *int64) (*outbox.NextClaim, [][]row) {
	if !claimNext || r.hooks.Unordered {
		return nil, nil
	}
	select {
	case <-r.stopping:
		return nil, nil
	default:
	}
	// The last published event of each aggregate.
	last := map[aggregateKey]row{}
	for i, res := range results {
		if res.acked && rows[i].AggregateSeq.Valid {
			if l, ok := last[keyOf(rows[i])]; !ok || l.AggregateSeq.Int64 < rows[i].AggregateSeq.Int64 {
				last[keyOf(rows[i])] = rows[i]
			}
		}
	}
	if len(last) == 0 {
		return nil, nil
	}
	published := make([]row, 0, len(last))
	for _, rw := range last {
		published = append(published, rw)
	}
	// In id order, so that a chunk's next events lie near each other in
	// the table (as the claim loop's, taken in id order, do): a chunk of
	// aggregates picked at random touches a page per event.
	sortRows(published)
	var rest [][]row
	if per := max(1, r.cfg.BatchSize/claimNextDepth); len(published) > per {
		for more := published[per:]; len(more) > 0; more = more[min(per, len(more)):] {
			rest = append(rest, more[:min(per, len(more))])
		}
		published = published[:per]
	}
	for want := int64(len(published)*claimNextDepth) - *held; want > 0; want /= 2 {
		if r.slots.TryAcquire(want) {
			*held += want
			break
		}
	}
	return &outbox.NextClaim{Published: published, Token: newLeaseToken(), Depth: claimNextDepth, N: int(*held)}, rest
}

// continueAsync claims and delivers the next events of the aggregates of
// published in the background, once it has slots for them.
func (r *Relay) continueAsync(ctx context.Context, published []row) {
	r.batches.Add(1)
	go func() {
		defer r.batches.Done()
		held := int64(len(published) * claimNextDepth)
		acquireCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		go func() {
			select {
			case <-r.stopping:
				cancel()
			case <-acquireCtx.Done():
			}
		}()
		if err := r.slots.Acquire(acquireCtx, held); err != nil {
			return // stopping: the claims find them after the restart
		}
		defer func() { r.slots.Release(held) }()
		token := newLeaseToken()
		start := time.Now()
		next, err := r.store.ClaimNext(ctx, published, token, claimNextDepth, int(held))
		if err != nil {
			r.logger.Warn("claim the next events of the aggregates published; the claims will find them", "error", err)
			return
		}
		if len(next) == 0 {
			return
		}
		r.obs.Claimed(len(next), time.Since(start))
		r.deliver(ctx, next, token, true, &held)
	}()
}

// publishAll publishes rows asynchronously and waits for their PubAcks, but
// never past the publish timeout. It returns each row's outcome, or false
// if ctx ended first (outcomes unknown).
func (r *Relay) publishAll(ctx context.Context, rows []row) ([]outcome, bool) {
	results := make([]outcome, len(rows))
	futures := make([]jetstream.PubAckFuture, len(rows))
	maxPayload := r.nc.MaxPayload()
	for i, rw := range rows {
		msg, err := r.message(rw, maxPayload)
		if err != nil {
			results[i] = outcome{permanent: true, err: rowReason(rw.ID, err)}
			continue
		}
		if r.hooks.FailPublish != nil && r.hooks.FailPublish(rw.ID) {
			results[i] = outcome{err: "nats: no responders available for request (injected by a test hook)"}
			continue
		}
		if r.hooks.SkipPublish != nil && r.hooks.SkipPublish(rw.ID) {
			results[i] = outcome{acked: true, ackedAt: time.Now()} // a lie
			continue
		}
		// message() set Nats-Msg-Id and Nats-Expected-Stream: publish
		// options would set them again, validating each name (about a
		// twentieth of the relay's CPU in a drain, bench:relay's profile).
		f, err := r.js.PublishMsgAsync(msg)
		if err != nil {
			results[i] = classify(rw.ID, err)
			continue
		}
		futures[i] = f
	}

	deadline := time.NewTimer(r.cfg.PublishTimeout)
	defer deadline.Stop()
	timedOut := false
	for i, f := range futures {
		if f == nil {
			continue
		}
		if timedOut {
			results[i] = outcome{err: "no PubAck within relay.publish_timeout"}
			continue
		}
		select {
		case ack := <-f.Ok():
			results[i] = outcome{acked: true, duplicate: ack.Duplicate, ackedAt: time.Now()}
		case err := <-f.Err():
			results[i] = classify(rows[i].ID, err)
		case <-deadline.C:
			timedOut = true
			results[i] = outcome{err: "no PubAck within relay.publish_timeout"}
		case <-ctx.Done():
			return nil, false
		}
	}
	return results, true
}

// message builds the NATS message for a row, or says why it can never be
// published. Rows are not only written through package outbox (other
// languages, plain SQL), so its rules are applied again here: whatever a row
// holds, what passes is carried by nats.go and nats-server unchanged, and
// nothing the relay sends can make the server drop its connection (which
// would stall every row, not just this one).
func (r *Relay) message(rw row, maxPayload int64) (*nats.Msg, error) {
	if err := outbox.ValidEventType(rw.EventType); err != nil {
		return nil, err
	}
	if err := outbox.ValidateAggregate(rw.AggregateType, rw.AggregateID); err != nil {
		return nil, err
	}
	if !rw.CreatedAt.Valid {
		return nil, fmt.Errorf("%w: created_at is not a readable point in time", outbox.ErrInvalidEvent)
	}
	if rw.CreatedAt.InfinityModifier != pgtype.Finite {
		return nil, fmt.Errorf("%w: created_at is %s, not a point in time", outbox.ErrInvalidEvent, rw.CreatedAt.InfinityModifier)
	}
	headers, err := decodeHeaders(rw.Headers)
	if err != nil {
		return nil, err
	}
	msg := &nats.Msg{
		Subject: stream.Subject(r.stream.SubjectPrefix, rw.EventType),
		Data:    rw.Payload,
		Header:  make(nats.Header, len(headers)+8),
	}
	// Every header has one value: one array holds them all, rather than an
	// allocation per header for every event.
	values := make([]string, 0, len(headers)+8)
	set := func(k, v string) {
		values = append(values, v)
		msg.Header[k] = values[len(values)-1 : len(values) : len(values)]
	}
	// ValidateHeaders refused the names the relay sets below, so a
	// writer's header never replaces one of them.
	for k, v := range headers {
		set(k, v)
	}
	id := strconv.FormatInt(rw.ID, 10)
	// The keys are constants already in canonical form: no Set needed.
	set(outbox.EventIDHeader, id)
	set(outbox.EventTypeHeader, rw.EventType)
	set(outbox.AggregateTypeHeader, rw.AggregateType)
	set(outbox.AggregateIDHeader, rw.AggregateID)
	set(outbox.CreatedAtHeader, rw.CreatedAt.Time.UTC().Format(time.RFC3339Nano))
	if rw.AggregateSeq.Valid {
		set(outbox.AggregateSeqHeader, strconv.FormatInt(rw.AggregateSeq.Int64, 10))
	}
	// JetStream's own: the id it drops duplicates by, and the stream the
	// event must land in (publishAll passes no publish options).
	set(jetstream.MsgIDHeader, id)
	set(jetstream.ExpectedStreamHeader, r.stream.Name)
	hdr := msg.Size() - len(msg.Subject) - len(msg.Data)
	if hdr > math.MaxUint16 {
		// JetStream refuses a larger header block (error 10097). The
		// outbox limits keep rows far below it; this guards the sum.
		return nil, fmt.Errorf("%w: the headers are %d bytes, over JetStream's limit of %d", ErrEventTooLarge, hdr, math.MaxUint16)
	}
	if size := int64(hdr + len(msg.Data)); maxPayload > 0 && size > maxPayload {
		return nil, fmt.Errorf("%w: event is %d bytes with headers, over the server's max_payload of %d bytes", ErrEventTooLarge, size, maxPayload)
	}
	return msg, nil
}

// ErrEventTooLarge is the reason given for rows over the server's max_payload
// or JetStream's limit on headers.
var ErrEventTooLarge = errors.New("event too large")

// jsErrCodeHeaderTooLarge is JetStream's "header size exceeds maximum
// allowed of 64k"; nats.go has no constant for it.
const jsErrCodeHeaderTooLarge jetstream.ErrorCode = 10097

// classify turns a publish error into an outcome: permanent errors are about
// the row itself and will never succeed; the rest are retried with backoff.
// message() should have refused every row that fails permanently; these
// cases catch a rule it misses, which would otherwise retry forever.
func classify(id int64, err error) outcome {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", ErrEventTooLarge, err))}
	case errors.Is(err, nats.ErrBadSubject), errors.Is(err, nats.ErrBadHeaderMsg):
		return outcome{permanent: true, err: rowReason(id, err)}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", ErrEventTooLarge, apiErr))}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeHeaderTooLarge:
		return outcome{permanent: true, err: rowReason(id, fmt.Errorf("%w: %v", ErrEventTooLarge, apiErr))}
	default:
		return outcome{err: err.Error()}
	}
}

// rowReason is the last_error of a row marked failed: it names the row, so
// that the reason stands alone in a log line or an operator's query.
func rowReason(id int64, err error) string {
	return fmt.Sprintf("outbox row %d: %v", id, err)
}

// sortRows orders a claimed batch by id, so one relay publishes in id order.
func sortRows(rows []row) {
	slices.SortFunc(rows, func(a, b row) int { return cmp.Compare(a.ID, b.ID) })
}
