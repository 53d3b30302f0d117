package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// check verifies the invariants after the drain; each violation names the
// event ids involved.
func (r *run) check() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep := r.report
	p := r.planted
	rep.Planted = p.kinds
	pool := r.pool()

	// 1. Every committed outbox row is sent or failed with a reason; the
	//    failed ones are exactly the planted ones.
	_ = pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status = 'failed') FROM outbox`).Scan(&rep.OutboxRows, &rep.FailedRows)
	var notSent []string
	var unexpectedFailed []string
	rows, err := pool.Query(ctx, `SELECT id, status, coalesce(last_error, '') FROM outbox WHERE status <> 'sent' ORDER BY id`)
	if err != nil {
		rep.violate("1 (outbox)", err.Error())
	} else {
		var id int64
		var status, reason string
		_, err = pgx.ForEachRow(rows, []any{&id, &status, &reason}, func() error {
			want, isPlanted := p.failedRows[id]
			switch {
			case status != "failed":
				notSent = append(notSent, fmt.Sprintf("%d (%s)", id, status))
			case reason == "":
				notSent = append(notSent, fmt.Sprintf("%d (failed without a reason)", id))
			case !isPlanted || !strings.Contains(reason, want):
				unexpectedFailed = append(unexpectedFailed, fmt.Sprintf("%d (%s)", id, reason))
			}
			return nil
		})
		if err != nil {
			rep.violate("1 (outbox)", err.Error())
		}
	}
	if len(notSent) > 0 {
		rep.violate("1 (every committed row sent or failed with a reason)", "rows "+head(notSent))
	}
	if len(unexpectedFailed) > 0 {
		rep.violate("1 (only planted rows failed)", "rows "+head(unexpectedFailed))
	}
	var failedPlanted int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status = 'failed'`).Scan(&failedPlanted)
	if failedPlanted != len(p.failedRows) {
		rep.violate("1 (planted rows failed)", fmt.Sprintf("%d rows failed, %d were planted to", failedPlanted, len(p.failedRows)))
	}

	// 2. Every event in the stream for a subscriber's filter is in its
	//    checkpoint or its dead letters. 6. Nothing in the dead letters was
	//    not planted.
	dead := r.deadLetters(ctx)
	rep.DeadLetters = map[string]int{}
	for s, ids := range dead {
		rep.DeadLetters[s] = len(ids)
	}
	stream, err := r.js.Stream(ctx, "EVENTS")
	if err == nil {
		if info, err := stream.Info(ctx); err == nil {
			rep.Events = info.State.Msgs
		}
	}
	for name, filters := range subscriberFilters {
		events, err := r.streamEvents(ctx, filters)
		if err != nil {
			rep.violate("2 ("+name+")", err.Error())
			continue
		}
		done := map[int64]bool{}
		rows, err := pool.Query(ctx, `SELECT event_id FROM processed_events WHERE subscriber = $1`, name)
		if err == nil {
			ids, _ := pgx.CollectRows(rows, pgx.RowTo[int64])
			for _, id := range ids {
				done[id] = true
			}
		}
		var missing []string
		for id := range events {
			if _, deadLettered := dead[name][id]; !done[id] && !deadLettered {
				missing = append(missing, strconv.FormatInt(id, 10))
			}
		}
		if len(missing) > 0 {
			rep.violate("2 (every event checkpointed or dead-lettered)", fmt.Sprintf("%s: %d of %d events neither: %s", name, len(missing), len(events), head(missing)))
		}
		var unexpected []string
		for id, dl := range dead[name] {
			if !r.expectedDeadLetter(ctx, name, id, dl) {
				unexpected = append(unexpected, fmt.Sprintf("event %d %s: %s", id, dl.typ, dl.reason))
			}
		}
		if len(unexpected) > 0 {
			rep.violate("6 (only planted events dead-lettered)", name+": "+head(unexpected))
		}
	}
	if len(dead["invoicing"]) < len(p.deadLetters) {
		rep.violate("6 (planted events dead-lettered)", fmt.Sprintf("invoicing has %d dead letters, %d were planted", len(dead["invoicing"]), len(p.deadLetters)))
	}

	// 3. Exactly one invoice per order, none for rolled-back orders.
	rows, err = pool.Query(ctx, `
SELECT o.id, count(i.id) FROM orders o LEFT JOIN invoices i ON i.order_id = o.id
GROUP BY o.id HAVING count(i.id) <> 1`)
	if err == nil {
		var id, n int64
		var wrong []string
		_, _ = pgx.ForEachRow(rows, []any{&id, &n}, func() error {
			if !r.plantedBadOrder(ctx, id) {
				wrong = append(wrong, fmt.Sprintf("order %d has %d invoices", id, n))
			}
			return nil
		})
		if len(wrong) > 0 {
			rep.violate("3 (exactly one invoice per order)", head(wrong))
		}
	}
	var ghost int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = ANY($1)`, p.rolledBack).Scan(&ghost)
	if ghost > 0 {
		rep.violate("3 (no invoice for rolled-back orders)", fmt.Sprintf("%d invoices for orders %v", ghost, p.rolledBack))
	}

	// 4. Every search document equals its SQL join; no deleted product has
	//    one. The planted rejected products are, rightly, missing.
	if cur, err := searchindex.Current(ctx, r.search, r.alias); err != nil || cur == "" {
		rep.violate("4 (search)", fmt.Sprintf("no index behind %s: %v", r.alias, err))
	} else {
		_ = r.search.Refresh(ctx, cur)
		d, err := searchindex.Check(ctx, r.search, pool, cur, 0)
		if err != nil {
			rep.violate("4 (search)", err.Error())
		} else {
			var missing []int64
			for _, id := range d.Missing {
				if !p.rejectedProds[id] {
					missing = append(missing, id)
				}
			}
			if len(missing)+len(d.Different)+len(d.Extra) > 0 {
				rep.violate("4 (every document equals SQL, no deleted product indexed)",
					fmt.Sprintf("missing %v, different %v, deleted but indexed %v", cut(missing), cut(d.Different), cut(d.Extra)))
			}
		}
	}

	// 5. No cached product is older than its SQL version.
	r.checkCache(ctx)
}

// event is one stream message's id and, for dead letters, the reason.
type event struct {
	seq    uint64
	typ    string
	body   []byte
	reason string
}

// streamEvents reads the events matching filters from the stream.
func (r *run) streamEvents(ctx context.Context, filters []string) (map[int64]event, error) {
	subjects := make([]string, len(filters))
	for i, f := range filters {
		subjects[i] = "events." + f
	}
	oc, err := r.js.OrderedConsumer(ctx, "EVENTS", jetstream.OrderedConsumerConfig{FilterSubjects: subjects})
	if err != nil {
		return nil, err
	}
	out := map[int64]event{}
	for {
		batch, err := oc.Fetch(1000, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return nil, err
		}
		n := 0
		for m := range batch.Messages() {
			n++
			id, _ := strconv.ParseInt(m.Headers().Get(outbox.EventIDHeader), 10, 64)
			md, _ := m.Metadata()
			ev := event{typ: m.Headers().Get(outbox.EventTypeHeader), body: m.Data()}
			if md != nil {
				ev.seq = md.Sequence.Stream
			}
			out[id] = ev
		}
		if n == 0 {
			// A whole second without a message: the stream is read (the
			// pipeline is drained and no writer runs any more).
			return out, nil
		}
	}
}

// deadLetters returns each subscriber's dead letters by event id, with the
// original event's type and body and the reason.
func (r *run) deadLetters(ctx context.Context) map[string]map[int64]event {
	out := map[string]map[int64]event{}
	for name := range subscriberFilters {
		out[name] = map[int64]event{}
	}
	s, err := r.js.Stream(ctx, "DEADLETTER")
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return out
	}
	if err != nil {
		r.report.violate("6 (dead letters)", err.Error())
		return out
	}
	info, err := s.Info(ctx)
	if err != nil {
		return out
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		name := m.Header.Get(subscribers.DeadSubscriberHeader)
		id, _ := strconv.ParseInt(m.Header.Get(outbox.EventIDHeader), 10, 64)
		if out[name] == nil {
			out[name] = map[int64]event{}
		}
		out[name][id] = event{seq: seq, typ: m.Header.Get(outbox.EventTypeHeader), body: m.Data, reason: m.Header.Get(subscribers.DeadReasonHeader)}
	}
	return out
}

// expectedDeadLetter says whether a subscriber's dead letter was planted.
func (r *run) expectedDeadLetter(ctx context.Context, subscriber string, id int64, ev event) bool {
	p := r.planted
	switch subscriber {
	case "invoicing":
		_, ok := p.deadLetters[id]
		return ok
	case "searchindex":
		// Events about a product the mapping refuses, and renames of its
		// brand (they reindex it).
		var body struct {
			ProductID int64 `json:"product_id"`
			BrandID   int64 `json:"brand_id"`
		}
		_ = json.Unmarshal(ev.body, &body)
		if ev.typ == shop.BrandUpdated {
			return p.rejectedBrands[body.BrandID]
		}
		return p.rejectedProds[body.ProductID]
	}
	return false
}

func (r *run) plantedBadOrder(ctx context.Context, orderID int64) bool {
	var planted bool
	_ = r.pool().QueryRow(ctx, `SELECT EXISTS (SELECT FROM order_lines WHERE order_id = $1 AND sku IS NULL AND product_id = 987654321)`, orderID).Scan(&planted)
	return planted
}

// checkCache compares every cached product with SQL.
func (r *run) checkCache(ctx context.Context) {
	var stale []string
	iter := r.rdb.Scan(ctx, 0, "product:*", 1000).Iterator()
	for iter.Next(ctx) {
		key := iter.Val()
		val, err := r.rdb.Get(ctx, key).Result()
		if err != nil || val == "tombstone" {
			continue
		}
		versionText, _, _ := strings.Cut(val, "\n")
		cached, _ := strconv.ParseInt(versionText, 10, 64)
		id, _ := strconv.ParseInt(strings.TrimPrefix(key, "product:"), 10, 64)
		var current int64
		err = r.pool().QueryRow(ctx, `SELECT version FROM products WHERE id = $1`, id).Scan(&current)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			stale = append(stale, fmt.Sprintf("product %d deleted but cached at version %d", id, cached))
		case err == nil && cached < current:
			stale = append(stale, fmt.Sprintf("product %d cached at version %d, SQL has %d", id, cached, current))
		}
	}
	if len(stale) > 0 {
		r.report.violate("5 (no cached product older than SQL)", head(stale))
	}
}

func head(xs []string) string {
	if len(xs) > 10 {
		return strings.Join(xs[:10], ", ") + fmt.Sprintf(" and %d more", len(xs)-10)
	}
	return strings.Join(xs, ", ")
}

func cut[T any](xs []T) []T {
	if len(xs) > 10 {
		return xs[:10]
	}
	return xs
}
