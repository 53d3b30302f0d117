package relay

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pgx/v5/pgtype"
)

// delivery publishes claimed batches and records their outcomes in
// Postgres, each aggregate's events in order (publishWaves), and goes on
// with the next events of the aggregates it published. The claim loop,
// the sweeper and a wal relay's backlog drain hand it their rows; the
// transaction delivery records through it.
type delivery struct {
	*core
	pub *publisher
	// testHookBeforeRecord, when set, runs after the PubAcks of a batch
	// arrived and before the batch is recorded in Postgres.
	testHookBeforeRecord func(ctx context.Context, ids []int64)
}

// deliverAsync publishes and records a claimed batch in the background;
// the batch holds its slots in flight until it is done. With claimNext, it
// goes on with the next events of the aggregates it publishes (deliver).
func (d *delivery) deliverAsync(hardCtx context.Context, rows []row, token pgtype.UUID, claimNext bool) {
	d.batches.Add(1)
	go func() {
		defer d.batches.Done()
		held := int64(len(rows))
		defer func() { d.slots.Release(held) }()
		d.deliver(hardCtx, rows, token, claimNext, &held)
	}()
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
func (d *delivery) deliver(ctx context.Context, rows []row, token pgtype.UUID, claimNext bool, held *int64) {
	for len(rows) > 0 {
		d.unrecorded.Add(int64(len(rows)))
		results, ok := d.publishWaves(ctx, rows)
		if !ok {
			// Hard stop: leave the rows `sending`; the reaper returns them.
			d.unrecorded.Add(-int64(len(rows)))
			return
		}
		d.beforeRecord(ctx, rows)
		next, rest := d.nextClaim(rows, results, claimNext, held)
		start := time.Now()
		claimed, ok := d.record(ctx, rows, token, results, next)
		d.unrecorded.Add(-int64(len(rows)))
		if !ok {
			return
		}
		// The other aggregates go on beside this delivery, once their
		// events are recorded (ClaimNext takes no more than the next ones).
		for _, chunk := range rest {
			d.continueAsync(ctx, chunk)
		}
		if next == nil {
			return
		}
		if len(claimed) > 0 {
			d.obs.Claimed(len(claimed), time.Since(start))
		}
		rows, token = claimed, next.Token
	}
}

// beforeRecord runs the test hook testHookBeforeRecord, if set, on the
// rows about to be recorded.
func (d *delivery) beforeRecord(ctx context.Context, rows []row) {
	if d.testHookBeforeRecord == nil {
		return
	}
	ids := make([]int64, len(rows))
	for i := range rows {
		ids[i] = rows[i].ID
	}
	d.testHookBeforeRecord(ctx, ids)
}

// nextClaim is the claim of the next events of the aggregates a delivery
// published (rows and their results), made with its record: for a batch's
// worth of aggregates (it takes the slots it can for them, up to
// claimNextDepth each); the others, in chunks of a batch's worth, go on
// in deliveries of their own (continueAsync), so that a busy backlog
// keeps several batches in flight, as the claim loop does. It is nil when
// there is nothing to go on with or the relay is stopping.
func (d *delivery) nextClaim(rows []row, results []outcome, claimNext bool, held *int64) (*outboxstore.NextClaim, [][]row) {
	if !claimNext || d.hooks.Unordered {
		return nil, nil
	}
	select {
	case <-d.stopping:
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
	if per := max(1, d.cfg.BatchSize/claimNextDepth); len(published) > per {
		for more := published[per:]; len(more) > 0; more = more[min(per, len(more)):] {
			rest = append(rest, more[:min(per, len(more))])
		}
		published = published[:per]
	}
	depth := d.nextDepth(len(published))
	for want := int64(len(published)*depth) - *held; want > 0; want /= 2 {
		if d.slots.TryAcquire(want) {
			*held += want
			break
		}
	}
	return &outboxstore.NextClaim{Published: published, Token: newLeaseToken(), Depth: depth, N: int(*held)}, rest
}

// nextDepth is how many events of each of n aggregates a delivery claims
// next: claimNextDepth, or, where atomic batches carry them (atomic.go),
// as many as fill a batch. A backlog of few aggregates (a bulk import of
// one product's history) then moves a batch a round trip instead of
// eight events.
func (d *delivery) nextDepth(n int) int {
	if !d.pub.atomicOK.Load() || n <= 0 {
		return claimNextDepth
	}
	return max(claimNextDepth, d.cfg.BatchSize/n)
}

// continueAsync claims and delivers the next events of the aggregates of
// published in the background, once it has slots for them.
func (d *delivery) continueAsync(ctx context.Context, published []row) {
	d.batches.Add(1)
	go func() {
		defer d.batches.Done()
		held := int64(len(published) * claimNextDepth)
		acquireCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		go func() {
			select {
			case <-d.stopping:
				cancel()
			case <-acquireCtx.Done():
			}
		}()
		if err := d.slots.Acquire(acquireCtx, held); err != nil {
			return // stopping: the claims find them after the restart
		}
		defer func() { d.slots.Release(held) }()
		token := newLeaseToken()
		start := time.Now()
		next, err := d.store.ClaimNext(ctx, published, token, claimNextDepth, int(held))
		if err != nil {
			d.logger.Warn("claim the next events of the aggregates published; the claims will find them", "error", err)
			return
		}
		if len(next) == 0 {
			return
		}
		d.obs.Claimed(len(next), time.Since(start))
		d.deliver(ctx, next, token, true, &held)
	}()
}

// record writes the batch's outcomes in one transaction, retrying while
// Postgres is unreachable (a restart, a failover) for up to half the lease.
// If it still cannot, the rows stay `sending` and the reaper returns them;
// their second publish is dropped by JetStream as a duplicate. It returns
// whether it recorded them, and the rows next claimed with them (see
// outboxstore.Outcomes.Next).
func (d *delivery) record(ctx context.Context, rows []row, token pgtype.UUID, results []outcome, next *outboxstore.NextClaim) ([]row, bool) {
	var sentIDs, retryIDs, failedIDs, returnedIDs []int64
	var retryReasons, failedReasons []string
	var published []Published
	var landed []outboxstore.Landed
	for i, res := range results {
		id := rows[i].ID
		switch {
		case res.acked:
			sentIDs = append(sentIDs, id)
			published = append(published, Published{ID: id, CreatedAt: rows[i].CreatedAt.Time, AckedAt: res.ackedAt, Duplicate: res.duplicate})
			if res.seq > 0 {
				landed = append(landed, outboxstore.Landed{ID: id, Seq: res.seq})
			}
		case res.permanent:
			failedIDs = append(failedIDs, id)
			failedReasons = append(failedReasons, res.err)
		case res.returned:
			returnedIDs = append(returnedIDs, id)
		default:
			retryIDs = append(retryIDs, id)
			retryReasons = append(retryReasons, res.err)
		}
	}

	var sent int64
	var claimed []row
	op := func() (struct{}, error) {
		var err error
		sent, claimed, err = d.store.Record(ctx, token, outboxstore.Outcomes{
			Sent:  sentIDs,
			Retry: retryIDs, RetryReasons: retryReasons, RetryMin: d.cfg.RetryMin, RetryMax: d.cfg.RetryMax,
			Failed: failedIDs, FailedReasons: failedReasons,
			Returned: returnedIDs,
			Landed:   landed, Stream: d.stream.Name,
			Next: next,
		})
		if err != nil && ctx.Err() != nil {
			return struct{}{}, backoff.Permanent(err)
		}
		return struct{}{}, err
	}
	_, err := backoff.Retry(ctx, op,
		backoff.WithBackOff(&backoff.ExponentialBackOff{
			InitialInterval: 50 * time.Millisecond, RandomizationFactor: 0.3, Multiplier: 2, MaxInterval: 2 * time.Second,
		}),
		backoff.WithMaxElapsedTime(d.cfg.Lease/2),
		backoff.WithNotify(func(err error, next time.Duration) {
			d.logger.Warn("record published batch, will retry", "error", err, "retry_in", next, "rows", len(rows))
		}))
	if err != nil {
		d.logger.Error("record published batch: giving up; the reaper will return the rows after their lease",
			"error", err, "rows", len(rows), "first_id", rows[0].ID)
		return nil, false
	}
	if int(sent) < len(sentIDs) {
		// Another relay holds these rows now (our lease expired); it will
		// publish them again and JetStream will drop the duplicate.
		d.logger.Warn("lease lost before marking sent", "rows", len(sentIDs)-int(sent))
	}
	d.reportPublished(published, len(retryIDs), len(failedIDs))
	if len(retryIDs) > 0 {
		d.obs.Retried(len(retryIDs))
		d.logger.Warn("publish failed, rows will be retried", "rows", len(retryIDs), "first_id", retryIDs[0], "error", retryReasons[0])
	}
	if len(failedIDs) > 0 {
		d.obs.Failed(len(failedIDs))
		for i, id := range failedIDs {
			d.logger.Error("outbox row can never be published: marked failed", "event_id", id, "reason", failedReasons[i])
		}
	}
	return claimed, true
}

// reportPublished tells the observer about rows stored in the stream, and
// logs the batch; the fault run's report sums the line's duplicates.
func (d *delivery) reportPublished(published []Published, retried, failed int) {
	if len(published) == 0 {
		return
	}
	d.obs.Published(published)
	dups := 0
	for _, p := range published {
		if p.Duplicate {
			dups++
		}
	}
	d.logger.Debug("batch recorded", "sent", len(published), "duplicates", dups, "retried", retried, "failed", failed)
}

// publishWaves publishes a claimed batch an aggregate's event at a time:
// wave k holds the k-th event of each aggregate in the batch, and goes
// once every event of wave k-1 has its PubAck (the stream then holds them
// in order, whatever happens to the later ones). An aggregate whose event
// was not acked publishes nothing more from this batch: its later rows are
// returned to pending as they were (a failed event holds them, and a
// retried one must go first), unless relay.on_failed is skip and the
// event failed for good. A batch of one event per aggregate, as the
// claim makes them, is one wave. It returns each row's outcome, or false
// if ctx ended first.
func (d *delivery) publishWaves(ctx context.Context, rows []row) ([]outcome, bool) {
	if d.hooks.Unordered {
		return d.pub.publishAll(ctx, rows)
	}
	w := wavesOf(rows)
	if len(w.keys) == len(rows) {
		return d.pub.publishAll(ctx, rows)
	}
	results := make([]outcome, len(rows))
	// The waves one after the other, as atomic batches (atomic.go): what
	// they store is a first part of each aggregate's events; the rest, if
	// any, go a wave at a time below.
	var chain []int
	for wave := range w.n {
		for _, k := range w.keys {
			if at := w.byAggregate[k]; wave < len(at) {
				chain = append(chain, at[wave])
			}
		}
	}
	chained := make([]row, len(chain))
	for j, i := range chain {
		chained[j] = rows[i]
	}
	res, done, err := d.pub.publishChain(ctx, chained)
	for j := range done {
		results[chain[j]] = res[j]
	}
	if done == len(chain) {
		return results, true
	}
	if ctx.Err() != nil {
		return nil, false
	}
	if !errors.Is(err, errNotAtomic) {
		d.logger.Debug("atomic batch refused; its events go a wave at a time", "rows", len(chain)-done, "error", err)
	}
	if !d.publishWaveByWave(ctx, rows, w, results) {
		return nil, false
	}
	return results, true
}

// waves is a batch's rows by aggregate, each aggregate's in the order of
// their numbers: wave k holds the k-th event of each.
type waves struct {
	keys        []aggregateKey // in the order of their first rows
	byAggregate map[aggregateKey][]int
	n           int // how many waves
}

func wavesOf(rows []row) waves {
	w := waves{byAggregate: map[aggregateKey][]int{}}
	for i, rw := range rows {
		k := keyOf(rw)
		if !rw.AggregateSeq.Valid {
			k = aggregateKey{typ: "\x00unnumbered", id: strconv.FormatInt(rw.ID, 10)} // not ordered: a wave of its own
		}
		if _, ok := w.byAggregate[k]; !ok {
			w.keys = append(w.keys, k)
		}
		w.byAggregate[k] = append(w.byAggregate[k], i)
	}
	for _, k := range w.keys {
		at := w.byAggregate[k]
		slices.SortFunc(at, func(a, b int) int { return cmp.Compare(rows[a].AggregateSeq.Int64, rows[b].AggregateSeq.Int64) })
		w.n = max(w.n, len(at))
	}
	return w
}

// publishWaveByWave publishes, a wave at a time, the rows of w that
// results does not have acked yet; an aggregate whose event was not acked
// publishes nothing more (its later rows are returned). It returns false
// if ctx ended first.
func (d *delivery) publishWaveByWave(ctx context.Context, rows []row, w waves, results []outcome) bool {
	skip := d.store.OnFailed == outboxstore.SkipFailed
	stopped := map[aggregateKey]bool{}
	for wave := range w.n {
		var idx []int
		for _, k := range w.keys {
			at := w.byAggregate[k]
			if wave >= len(at) || results[at[wave]].acked {
				continue
			}
			if stopped[k] {
				results[at[wave]] = outcome{returned: true}
				continue
			}
			idx = append(idx, at[wave])
		}
		if len(idx) == 0 {
			continue
		}
		batch := make([]row, len(idx))
		for j, i := range idx {
			batch[j] = rows[i]
		}
		res, ok := d.pub.publishAll(ctx, batch)
		if !ok {
			return false
		}
		for j, i := range idx {
			results[i] = res[j]
			if !res[j].acked && !(res[j].permanent && skip) {
				stopped[keyOf(rows[i])] = true
			}
		}
	}
	return true
}
