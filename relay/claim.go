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

// fullClaimEvery is how often a claim walks the unsent rows from the
// lowest id; the claims in between start from a floor near the newest rows
// (see claimSQL for why). A row below the floor (a lease reaped, a backoff
// over, an operator's retry, a writer whose transaction committed long
// after it took its id) waits for the next full walk, at most this long
// (or relay.poll_interval, when the relay is idle and that is longer).
const fullClaimEvery = time.Second

// claimFloor is where the claims between full walks start. The claim loop
// alone moves it; tests read it.
type claimFloor struct {
	after  atomic.Int64 // claims start above this id
	next   int64        // what the floor becomes at the next full walk
	newest int64        // the highest id claimed so far
	fullAt time.Time    // when the last full walk ran
}

// walked moves the floor after a full walk. Every row up to the walk's
// mark (below the first row it found, or up to the newest claimed if it
// found none) was claimed, or was not committed or not due when it ran.
// The floor lags one walk behind, taking the previous walk's mark: ids
// are taken in order, so a row below it whose transaction is still open
// has been open for at least fullClaimEvery, and only such rows (and the
// ones a full walk is there for) wait for the next one.
func (f *claimFloor) walked(rows []row, at time.Time) {
	f.fullAt = at
	mark := f.newest
	if len(rows) > 0 {
		mark = rows[0].ID - 1
	}
	if f.next > f.after.Load() {
		f.after.Store(f.next)
	}
	f.next = mark
}

func (r *Relay) claim(ctx context.Context) ([]row, pgtype.UUID, error) {
	token := newLeaseToken()
	full := time.Since(r.floor.fullAt) >= fullClaimEvery
	after := r.floor.after.Load()
	if full {
		after = math.MinInt64
	}
	// Nothing is decoded in the claim: message() judges each row on its
	// own, and a bad row becomes `failed`.
	claimed, err := r.store.ClaimRange(ctx, r.cfg.BatchSize, token, after, math.MaxInt64)
	if err != nil {
		return nil, token, err
	}
	sortRows(claimed)
	if full {
		r.floor.walked(claimed, time.Now())
	}
	if len(claimed) > 0 {
		r.floor.newest = max(r.floor.newest, claimed[len(claimed)-1].ID)
	}
	return claimed, token, nil
}

// record writes the batch's outcomes in one transaction, retrying while
// Postgres is unreachable (a restart, a failover) for up to half the lease.
// If it still cannot, the rows stay `sending` and the reaper returns them;
// their second publish is dropped by JetStream as a duplicate.
func (r *Relay) record(ctx context.Context, rows []row, token pgtype.UUID, results []outcome) {
	var sentIDs, retryIDs, failedIDs []int64
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
		return
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
