package relay

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5/pgtype"
)

// deliverAsync publishes and records a claimed batch in the background;
// the batch holds its slots in flight until it is done. With claimNext, it
// goes on with the next events of the aggregates it publishes (deliver).
func (r *Relay) deliverAsync(hardCtx context.Context, rows []row, token pgtype.UUID, claimNext bool) {
	r.batches.Add(1)
	go func() {
		defer r.batches.Done()
		held := int64(len(rows))
		defer func() { r.slots.Release(held) }()
		r.deliver(hardCtx, rows, token, claimNext, &held)
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
func (r *Relay) deliver(ctx context.Context, rows []row, token pgtype.UUID, claimNext bool, held *int64) {
	for len(rows) > 0 {
		r.unrecorded.Add(int64(len(rows)))
		results, ok := r.publishWaves(ctx, rows)
		if !ok {
			// Hard stop: leave the rows `sending`; the reaper returns them.
			r.unrecorded.Add(-int64(len(rows)))
			return
		}
		r.beforeRecord(ctx, rows)
		next, rest := r.nextClaim(rows, results, claimNext, held)
		start := time.Now()
		claimed, ok := r.record(ctx, rows, token, results, next)
		r.unrecorded.Add(-int64(len(rows)))
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

// beforeRecord runs the test hook testHookBeforeRecord, if set, on the
// rows about to be recorded.
func (r *Relay) beforeRecord(ctx context.Context, rows []row) {
	if r.testHookBeforeRecord == nil {
		return
	}
	ids := make([]int64, len(rows))
	for i := range rows {
		ids[i] = rows[i].ID
	}
	r.testHookBeforeRecord(ctx, ids)
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
	depth := r.nextDepth(len(published))
	for want := int64(len(published)*depth) - *held; want > 0; want /= 2 {
		if r.slots.TryAcquire(want) {
			*held += want
			break
		}
	}
	return &outbox.NextClaim{Published: published, Token: newLeaseToken(), Depth: depth, N: int(*held)}, rest
}

// nextDepth is how many events of each of n aggregates a delivery claims
// next: claimNextDepth, or, where atomic batches carry them (atomic.go),
// as many as fill a batch. A backlog of few aggregates (a bulk import of
// one product's history) then moves a batch a round trip instead of
// eight events.
func (r *Relay) nextDepth(n int) int {
	if !r.atomicOK.Load() || n <= 0 {
		return claimNextDepth
	}
	return max(claimNextDepth, r.cfg.BatchSize/n)
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

// record writes the batch's outcomes in one transaction, retrying while
// Postgres is unreachable (a restart, a failover) for up to half the lease.
// If it still cannot, the rows stay `sending` and the reaper returns them;
// their second publish is dropped by JetStream as a duplicate. It returns
// whether it recorded them, and the rows next claimed with them (see
// outbox.Outcomes.Next).
func (r *Relay) record(ctx context.Context, rows []row, token pgtype.UUID, results []outcome, next *outbox.NextClaim) ([]row, bool) {
	var sentIDs, retryIDs, failedIDs, returnedIDs []int64
	var retryReasons, failedReasons []string
	var published []Published
	var landed []outbox.Landed
	for i, res := range results {
		id := rows[i].ID
		switch {
		case res.acked:
			sentIDs = append(sentIDs, id)
			published = append(published, Published{ID: id, CreatedAt: rows[i].CreatedAt.Time, AckedAt: res.ackedAt, Duplicate: res.duplicate})
			if res.seq > 0 {
				landed = append(landed, outbox.Landed{ID: id, Seq: res.seq})
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
		sent, claimed, err = r.store.Record(ctx, token, outbox.Outcomes{
			Sent:  sentIDs,
			Retry: retryIDs, RetryReasons: retryReasons, RetryMin: r.cfg.RetryMin, RetryMax: r.cfg.RetryMax,
			Failed: failedIDs, FailedReasons: failedReasons,
			Returned: returnedIDs,
			Landed:   landed, Stream: r.stream.Name,
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
		backoff.WithMaxElapsedTime(r.cfg.Lease/2),
		backoff.WithNotify(func(err error, next time.Duration) {
			r.logger.Warn("record published batch, will retry", "error", err, "retry_in", next, "rows", len(rows))
		}))
	if err != nil {
		r.logger.Error("record published batch: giving up; the reaper will return the rows after their lease",
			"error", err, "rows", len(rows), "first_id", rows[0].ID)
		return nil, false
	}
	if int(sent) < len(sentIDs) {
		// Another relay holds these rows now (our lease expired); it will
		// publish them again and JetStream will drop the duplicate.
		r.logger.Warn("lease lost before marking sent", "rows", len(sentIDs)-int(sent))
	}
	r.reportPublished(published, len(retryIDs), len(failedIDs))
	if len(retryIDs) > 0 {
		r.obs.Retried(len(retryIDs))
		r.logger.Warn("publish failed, rows will be retried", "rows", len(retryIDs), "first_id", retryIDs[0], "error", retryReasons[0])
	}
	if len(failedIDs) > 0 {
		r.obs.Failed(len(failedIDs))
		for i, id := range failedIDs {
			r.logger.Error("outbox row can never be published: marked failed", "event_id", id, "reason", failedReasons[i])
		}
	}
	return claimed, true
}

// reportPublished tells the observer about rows stored in the stream, and
// logs the batch; the fault run's report sums the line's duplicates.
func (r *Relay) reportPublished(published []Published, retried, failed int) {
	if len(published) == 0 {
		return
	}
	r.obs.Published(published)
	dups := 0
	for _, p := range published {
		if p.Duplicate {
			dups++
		}
	}
	r.logger.Debug("batch recorded", "sent", len(published), "duplicates", dups, "retried", retried, "failed", failed)
}
