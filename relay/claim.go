package relay

import (
	"context"
	"math"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5/pgtype"
)

// fullClaimEvery is how often the sweeper claims the rows below the
// floor, walking from the lowest id; the claim loop starts from the floor
// (see claimSQL for why). A row below it (a lease reaped, a backoff over,
// an operator's retry, a writer whose transaction committed long after it
// took its id) waits for the next sweep, at most this long.
const fullClaimEvery = time.Second

// claimFloor splits the claims: the claim loop takes rows above the floor,
// the sweeper those at or below it.
type claimFloor struct {
	after  atomic.Int64 // the floor: the claim loop starts above this id
	newest atomic.Int64 // the highest id the claim loop claimed
	next   int64        // the floor after the next sweep (the sweeper's)
}

// swept moves the floor after a sweep to the newest id claimed when the
// previous sweep began. Ids are taken in order, so a row below it that
// was not claimed yet belongs to a transaction open since before then, at
// least fullClaimEvery ago: the floor lags a sweep behind the newest rows
// so that only such rows (and the ones a sweep is there for) fall below it.
func (f *claimFloor) swept(newestAtStart int64) {
	if f.next > f.after.Load() {
		f.after.Store(f.next)
	}
	f.next = newestAtStart
}

func (r *Relay) claim(ctx context.Context) ([]row, pgtype.UUID, error) {
	token := newLeaseToken()
	// Nothing is decoded in the claim: message() judges each row on its
	// own, and a bad row becomes `failed`.
	claimed, err := r.store.ClaimRange(ctx, r.cfg.BatchSize, token, r.floor.after.Load(), math.MaxInt64)
	if err != nil {
		return nil, token, err
	}
	sortRows(claimed)
	if n := len(claimed); n > 0 && claimed[n-1].ID > r.floor.newest.Load() {
		r.floor.newest.Store(claimed[n-1].ID)
	}
	return claimed, token, nil
}

// sweepLoop claims the rows at or below the floor every fullClaimEvery.
// It runs beside the claim loop, so that its walk from the lowest id,
// slow under a held snapshot, holds up none of the newest rows.
func (r *Relay) sweepLoop(softCtx, hardCtx context.Context) {
	t := time.NewTicker(fullClaimEvery)
	defer t.Stop()
	for {
		select {
		case <-r.stopping:
			return
		case <-softCtx.Done():
			return
		case <-t.C:
		}
		newest := r.floor.newest.Load()
		if !r.sweep(softCtx, hardCtx) {
			continue // the floor stays until a sweep completes
		}
		r.floor.swept(newest)
	}
}

// sweep claims and delivers every due row at or below the floor; it
// returns false if it could not finish (NATS or Postgres unreachable, a
// stop), leaving the rest to the next one.
func (r *Relay) sweep(softCtx, hardCtx context.Context) bool {
	floor := r.floor.after.Load()
	batch := int64(r.cfg.BatchSize)
	for {
		if !r.nc.IsConnected() {
			return false
		}
		if err := r.slots.Acquire(softCtx, batch); err != nil {
			return false
		}
		token := newLeaseToken()
		start := time.Now()
		// On hardCtx, as the claim loop's: a claim cancelled after the
		// server committed would strand its rows until their lease ends.
		rows, err := r.store.ClaimRange(hardCtx, r.cfg.BatchSize, token, math.MinInt64, floor)
		r.slots.Release(batch - int64(len(rows)))
		if err != nil {
			r.logger.Warn("claim the rows below the claim floor; the next sweep tries again", "error", err, "floor", floor)
			return false
		}
		if len(rows) == 0 {
			return true
		}
		r.obs.Claimed(len(rows), time.Since(start))
		sortRows(rows)
		r.deliverAsync(hardCtx, rows, token)
		if len(rows) < r.cfg.BatchSize {
			return true
		}
	}
}

// deliverAsync publishes and records a claimed batch in the background;
// the batch holds its slots in flight until it is done.
func (r *Relay) deliverAsync(hardCtx context.Context, rows []row, token pgtype.UUID) {
	r.batches.Add(1)
	go func() {
		defer r.batches.Done()
		held := int64(len(rows))
		defer func() { r.slots.Release(held) }()
		r.deliver(hardCtx, rows, token, true, &held)
	}()
}

// record writes the batch's outcomes in one transaction, retrying while
// Postgres is unreachable (a restart, a failover) for up to half the lease.
// If it still cannot, the rows stay `sending` and the reaper returns them;
// their second publish is dropped by JetStream as a duplicate. It returns
// whether it recorded them.
func (r *Relay) record(ctx context.Context, rows []row, token pgtype.UUID, results []outcome) bool {
	var sentIDs, retryIDs, failedIDs, returnedIDs []int64
	var retryReasons, failedReasons []string
	var published []Published
	for i, res := range results {
		id := rows[i].ID
		switch {
		case res.acked:
			sentIDs = append(sentIDs, id)
			published = append(published, Published{ID: id, CreatedAt: rows[i].CreatedAt.Time, AckedAt: res.ackedAt, Duplicate: res.duplicate})
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
	op := func() (struct{}, error) {
		var err error
		sent, err = r.store.Record(ctx, token, outbox.Outcomes{
			Sent:  sentIDs,
			Retry: retryIDs, RetryReasons: retryReasons, RetryMin: r.cfg.RetryMin, RetryMax: r.cfg.RetryMax,
			Failed: failedIDs, FailedReasons: failedReasons,
			Returned: returnedIDs,
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
		return false
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
	return true
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
