package searchindex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DeletedVersion is the external version of every deletion: above any
// product version, since a deleted product never comes back.
const DeletedVersion = math.MaxInt64 / 2

// docOutcome is what happened to one product's document.
type docOutcome struct {
	permanent error // the engine rejected the document for good
	// transient may pass later: the engine unavailable (Unavailable: held,
	// never counted) or nothing written for another reason (a plain error,
	// counted towards subscribers.max_failures).
	transient error
	// version is the version written (DeletedVersion for a deletion), and
	// result the engine's last answer: a repair reads them.
	version int64
	result  search.Result
}

func (o docOutcome) err() error {
	if o.permanent != nil {
		return o.permanent
	}
	return o.transient
}

// syncer writes products' current SQL state into an index.
type syncer struct {
	client   *search.Client
	pool     *pgxpool.Pool
	bulkSize int
	logger   *slog.Logger
	// retryWaits are the pauses before retrying 429/5xx items in place.
	retryWaits []time.Duration
	// items, if set, is told each bulk item's outcome (metrics).
	items func(outcome string)
	// versionType is the version type of every write: search.External (the
	// default, empty) for the indexer, whose racing instances must
	// converge; search.ExternalGTE only for a repair (Repair says why).
	versionType string
}

// outcome names a bulk item's result for metrics.
func outcome(r search.Result) string {
	switch {
	case r.Status == http.StatusConflict:
		return "conflict"
	case r.AlreadyDeleted():
		return "not_found"
	case r.Status < 300:
		return "ok"
	case r.Retryable():
		return "retry"
	case r.Status == http.StatusNotFound:
		return "failed"
	}
	return "rejected"
}

// Document is the JSON a product is indexed as.
func Document(p shop.Product) ([]byte, error) { return json.Marshal(p) }

// sync loads the products from SQL and writes each one's document (or its
// deletion) to index, retrying overloaded items a few times in place.
func (s *syncer) sync(ctx context.Context, index string, ids []int64) (map[int64]docOutcome, error) {
	out := make(map[int64]docOutcome, len(ids))
	for chunk := range slices.Chunk(ids, s.bulkSize) {
		products, err := shop.LoadProducts(ctx, s.pool, chunk)
		if err != nil {
			return nil, err
		}
		ops := make([]search.Op, 0, len(chunk))
		for _, id := range chunk {
			op := search.Op{ID: strconv.FormatInt(id, 10), VersionType: s.versionType}
			if p, ok := products[id]; ok {
				doc, err := Document(p)
				if err != nil {
					return nil, err
				}
				op.Doc, op.Version = doc, p.Version
			} else {
				op.Delete, op.Version = true, DeletedVersion
			}
			ops = append(ops, op)
		}
		if err := s.bulk(ctx, index, ops, out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// bulk sends ops and records each product's outcome; items the engine was
// too busy for are sent again after a pause.
func (s *syncer) bulk(ctx context.Context, index string, ops []search.Op, out map[int64]docOutcome) error {
	for attempt := 0; ; attempt++ {
		results, err := s.client.Bulk(ctx, index, ops)
		if err != nil {
			return engineError(ctx, err)
		}
		var again []search.Op
		for i, r := range results {
			if s.items != nil {
				s.items(outcome(r))
			}
			id, _ := strconv.ParseInt(ops[i].ID, 10, 64)
			o := docOutcome{version: ops[i].Version, result: r}
			switch {
			case r.OK():
			case r.Retryable():
				// Throttled (429) or in trouble (5xx): the engine's state,
				// not the document's.
				o.transient = subscribers.Unavailable(Dependency,
					fmt.Errorf("document %s: engine answered %d %s: %s", r.ID, r.Status, r.Type, r.Reason))
				again = append(again, ops[i])
			case r.Status == http.StatusNotFound:
				// Not a deletion of a missing document (that is OK): there
				// was no index to write to (index_not_found_exception: the
				// index behind the alias was deleted, and the engine may not
				// create one), and nothing was written. Acking would lose the
				// change. The engine answers and the document is not at
				// fault, but the gap will not close by itself either: a
				// plain failure, retried with the runtime's backoff and
				// dead-lettered with this reason after
				// subscribers.max_failures, so an operator hears of it.
				o.transient = fmt.Errorf("document %s not written: index %s answered %d %s: %s", r.ID, index, r.Status, r.Type, r.Reason)
			default:
				o.permanent = fmt.Errorf("document %s rejected by index %s: %d %s: %s", r.ID, index, r.Status, r.Type, r.Reason)
			}
			out[id] = o
		}
		if len(again) == 0 || attempt >= len(s.retryWaits) {
			return nil
		}
		s.logger.Warn("bulk items throttled or failed, retrying", "items", len(again), "attempt", attempt+1)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(s.retryWaits[attempt]):
		}
		ops = again
	}
}

// Dependency is the search engine's name among the indexer's dependencies.
const Dependency = "search"

// engineError marks a failed request as the engine being unavailable
// (unreachable, timing out on search.timeout, throttling, 5xx), unless the
// engine refused the request itself (a 4xx other than 429), which says
// something about the request, or the caller's own deadline ran out (the
// handler's time is up: a batch too slow for it is the batch's problem, and
// an outage verdict would hold it, and everything behind it, forever).
func engineError(ctx context.Context, err error) error {
	var e *search.Error
	if errors.As(err, &e) && e.Status >= 400 && e.Status < 500 && e.Status != http.StatusTooManyRequests {
		return err
	}
	if ctx.Err() != nil {
		return err
	}
	return subscribers.Unavailable(Dependency, err)
}
