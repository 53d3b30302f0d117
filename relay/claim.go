package relay

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5/pgtype"
)

func (r *Relay) claim(ctx context.Context) ([]row, pgtype.UUID, error) {
	token := newLeaseToken()
	// Nothing is decoded in the claim: message() judges each row on its
	// own, and a bad row becomes `failed`.
	claimed, err := r.store.Claim(ctx, r.cfg.BatchSize, token)
	if err != nil {
		return nil, token, err
	}
	sortRows(claimed)
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
