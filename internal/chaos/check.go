package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/fulfilment"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// check verifies the invariants after the drain; each violation names the
// event ids involved. Every read it makes is checked: a checker that
// cannot read something reports that, it never passes by default.
func (r *run) check() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep := r.report
	rep.Planted = r.planted.kinds

	stream, err := r.readStream(ctx)
	if err != nil {
		rep.violate("1 (read the stream)", err.Error())
		return
	}
	rep.Events = uint64(len(stream.bySeq))
	r.checkOutbox(ctx, stream)

	dead, err := r.deadLetters(ctx)
	if err != nil {
		rep.violate("5 (read the dead letters)", err.Error())
		return
	}
	r.checkDeadLetters(ctx, dead)
	r.checkDelivered(ctx, stream, dead)
	r.checkInvoices(ctx)
	r.checkLedger(ctx)
	r.checkFulfilment(ctx)
	r.checkSearch(ctx)
	r.checkCache(ctx)
}

// event is one stream message.
type event struct {
	id   int64
	seq  uint64
	subj string
	typ  string
	body []byte
}

// streamContents is the whole events stream, read to its last sequence.
type streamContents struct {
	bySeq []event
	byID  map[int64][]uint64 // event id -> the sequences holding it
}

// readPatience is how long reading a stream rides out a cluster that is
// not answering yet.
const readPatience = 2 * time.Minute

// readStream reads every message of EVENTS up to the last sequence the
// stream reports, and fails unless it got all of them.
func (r *run) readStream(ctx context.Context) (*streamContents, error) {
	start := time.Now()
	var s jetstream.Stream
	var info *jetstream.StreamInfo
	err := tryEverySecond(func() bool { return time.Since(start) > readPatience }, func(ictx context.Context) error {
		var err error
		if s, err = r.js.Stream(ictx, "EVENTS"); err == nil {
			info, err = s.Info(ictx)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	out := &streamContents{byID: map[int64][]uint64{}}
	if info.State.Msgs == 0 {
		return out, nil
	}
	// A cluster may still be electing leaders after the heal: a request
	// that finds no responder, or times out, is tried again (for up to
	// readPatience) from the sequence after the last one read, so nothing
	// is read twice or skipped.
	deadline := time.Now().Add(readPatience)
	var oc jetstream.Consumer
	last := uint64(0)
	retry := func(err error) error {
		if time.Now().After(deadline) {
			return fmt.Errorf("fetch after sequence %d: %w", last, err)
		}
		r.o.Logf("chaos: reading the stream after sequence %d: %v (tried again)", last, err)
		oc = nil
		time.Sleep(time.Second)
		return nil
	}
	for last < info.State.LastSeq {
		if oc == nil {
			cfg := jetstream.OrderedConsumerConfig{}
			if last > 0 {
				cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, last+1
			}
			if oc, err = s.OrderedConsumer(ctx, cfg); err != nil {
				if err := retry(err); err != nil {
					return nil, err
				}
				continue
			}
		}
		batch, err := oc.Fetch(1000, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			if err := retry(err); err != nil {
				return nil, err
			}
			continue
		}
		n := 0
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return nil, err
			}
			last = md.Sequence.Stream
			id, err := strconv.ParseInt(m.Headers().Get(outbox.EventIDHeader), 10, 64)
			if err != nil {
				return nil, fmt.Errorf("message %d carries no event id: %w", last, err)
			}
			out.bySeq = append(out.bySeq, event{id: id, seq: last, subj: m.Subject(), typ: m.Headers().Get(outbox.EventTypeHeader), body: m.Data()})
			out.byID[id] = append(out.byID[id], last)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			if err := retry(err); err != nil {
				return nil, err
			}
			continue
		}
		if n == 0 {
			if err := retry(fmt.Errorf("the stream reports messages up to sequence %d, but nothing came", info.State.LastSeq)); err != nil {
				return nil, err
			}
		}
	}
	if uint64(len(out.bySeq)) != info.State.Msgs {
		return nil, fmt.Errorf("read %d messages, the stream reports %d", len(out.bySeq), info.State.Msgs)
	}
	return out, nil
}

// checkOutbox: every committed outbox row is sent (and then in the stream
// exactly once) or failed with a reason, and only the planted rows failed;
// the stream holds nothing that is not a sent row.
func (r *run) checkOutbox(ctx context.Context, stream *streamContents) {
	rep, p := r.report, r.planted
	var err error
	if rep.Ranges, rep.SealedRanges, rep.DefaultRows, err = outbox.NewStore(r.pool()).RangeCounts(ctx); err != nil {
		rep.violate("1 (read the outbox's ranges)", err.Error())
		return
	}
	rows, err := r.pool().Query(ctx, `SELECT id, status, coalesce(last_error, ''), aggregate_type || '/' || aggregate_id, aggregate_seq FROM outbox ORDER BY id`)
	if err != nil {
		rep.violate("1 (read the outbox)", err.Error())
		return
	}
	var notSent, unexpectedFailed, missing, twice, failedPublished []string
	sent := map[int64]bool{}
	numbered := map[int64]aggregateEvent{}
	var id int64
	var status, reason, aggregate string
	var number *int64
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &reason, &aggregate, &number}, func() error {
		rep.OutboxRows++
		if number != nil {
			numbered[id] = aggregateEvent{aggregate, *number}
		}
		want, isPlanted := p.failedRows[id]
		switch {
		case status == "sent" || (r.wal() && status == "pending"):
			// In wal capture the relay publishes rows it decodes and
			// leaves them pending: each must be in the stream all the
			// same.
			sent[id] = true
			switch n := len(stream.byID[id]); {
			case n == 0:
				missing = append(missing, strconv.FormatInt(id, 10))
			case n > 1:
				twice = append(twice, fmt.Sprintf("%d (sequences %v)", id, stream.byID[id]))
			}
		case status != "failed":
			notSent = append(notSent, fmt.Sprintf("%d (%s)", id, status))
		case reason == "":
			notSent = append(notSent, fmt.Sprintf("%d (failed without a reason)", id))
		case !isPlanted || !strings.Contains(reason, want):
			rep.FailedRows++
			unexpectedFailed = append(unexpectedFailed, fmt.Sprintf("%d (%s)", id, reason))
		default:
			rep.FailedRows++
			if len(stream.byID[id]) > 0 {
				failedPublished = append(failedPublished, strconv.FormatInt(id, 10))
			}
		}
		return nil
	})
	if err != nil {
		rep.violate("1 (read the outbox)", err.Error())
		return
	}
	if len(notSent) > 0 {
		rep.violate("1 (every committed row sent or failed with a reason)", "rows "+head(notSent))
	}
	if len(missing) > 0 {
		rep.violate("1 (every sent row is in the stream)", fmt.Sprintf("%d sent rows missing from the stream: %s", len(missing), head(missing)))
	}
	if len(twice) > 0 {
		rep.violate("2 (every sent row is in the stream once)", fmt.Sprintf("%d events stored more than once: %s", len(twice), head(twice)))
	}
	if len(unexpectedFailed) > 0 {
		rep.violate("5 (only planted rows failed)", "rows "+head(unexpectedFailed))
	}
	if len(failedPublished) > 0 {
		rep.violate("5 (a failed row is never published)", "rows "+head(failedPublished))
	}
	var plantedNotFailed []string
	for id := range p.failedRows {
		if sent[id] {
			plantedNotFailed = append(plantedNotFailed, strconv.FormatInt(id, 10))
		}
	}
	if len(plantedNotFailed) > 0 || rep.FailedRows < int64(len(p.failedRows)) {
		rep.violate("5 (planted rows failed)", fmt.Sprintf("%d rows failed, %d were planted to; planted but sent: %s",
			rep.FailedRows, len(p.failedRows), head(plantedNotFailed)))
	}
	r.checkAggregateOrder(stream, sent, numbered)
	var phantoms []string
	for id, seqs := range stream.byID {
		if !sent[id] {
			phantoms = append(phantoms, fmt.Sprintf("event %d at %v", id, seqs))
		}
	}
	if len(phantoms) > 0 {
		slices.Sort(phantoms)
		rep.violate("1 (the stream holds only sent rows)", head(phantoms))
	}
}

// aggregateEvent is an event's place in its aggregate.
type aggregateEvent struct {
	aggregate string
	number    int64
}

// checkAggregateOrder: invariant 8 at the stream, where the relays must
// keep it. Every aggregate's published events are in the stream as 1, 2,
// 3, ... (the first copy of each; a second is invariant 2's). No poison
// row shares an aggregate with another event (plant.go), so no number is
// missing.
func (r *run) checkAggregateOrder(stream *streamContents, sent map[int64]bool, numbered map[int64]aggregateEvent) {
	last := map[string]int64{}
	seen := map[int64]bool{}
	var disorder []string
	unnumbered := 0
	for _, ev := range stream.bySeq {
		if seen[ev.id] || !sent[ev.id] {
			continue
		}
		seen[ev.id] = true
		a, ok := numbered[ev.id]
		if !ok {
			unnumbered++
			continue
		}
		if a.number != last[a.aggregate]+1 {
			disorder = append(disorder, fmt.Sprintf("%s: event %d (number %d) at sequence %d after number %d", a.aggregate, ev.id, a.number, ev.seq, last[a.aggregate]))
		}
		last[a.aggregate] = max(last[a.aggregate], a.number)
	}
	r.report.Aggregates = len(last)
	if unnumbered > 0 {
		r.report.violate("8 (every event numbered in its aggregate)", fmt.Sprintf("%d events in the stream have no aggregate_seq", unnumbered))
	}
	if len(disorder) > 0 {
		r.report.violate("8 (each aggregate's events enter the stream in commit order)", fmt.Sprintf("%d events out of order: %s", len(disorder), head(disorder)))
	}
}

// deadLetter is one message of the DEADLETTER stream.
type deadLetter struct {
	seq        uint64
	subject    string
	subscriber string
	id         int64
	typ        string
	body       []byte
	reason     string
}

// deadLetters reads the whole DEADLETTER stream.
func (r *run) deadLetters(ctx context.Context) ([]deadLetter, error) {
	s, err := r.js.Stream(ctx, "DEADLETTER")
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []deadLetter
	start := time.Now()
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		var m *jetstream.RawStreamMsg
		err := tryEverySecond(func() bool { return time.Since(start) > readPatience }, func(ictx context.Context) error {
			var err error
			m, err = s.GetMsg(ictx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				return nil
			}
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("dead letter %d: %w", seq, err)
		}
		if m == nil {
			continue // deleted (by an operator; nothing here deletes)
		}
		id, _ := strconv.ParseInt(m.Header.Get(outbox.EventIDHeader), 10, 64)
		out = append(out, deadLetter{seq: seq, subject: m.Subject, subscriber: m.Header.Get(subscribers.DeadSubscriberHeader), id: id,
			typ: m.Header.Get(outbox.EventTypeHeader), body: m.Data, reason: m.Header.Get(subscribers.DeadReasonHeader)})
	}
	if uint64(len(out)) != info.State.Msgs {
		return nil, fmt.Errorf("read %d dead letters, the stream reports %d", len(out), info.State.Msgs)
	}
	return out, nil
}

// checkDeadLetters: each dead letter belongs to a known subscriber (by its
// subject and its header alike) and matches a planted input by its reason;
// every planted input that must reach a subscriber's dead letters did.
func (r *run) checkDeadLetters(ctx context.Context, dead []deadLetter) {
	rep, p := r.report, r.planted
	rep.DeadLetters = map[string]map[string]int{}
	var orphans, unexpected []string
	got := map[string]map[int64]bool{}
	for _, dl := range dead {
		fromSubject := strings.Split(dl.subject, ".")
		if _, known := r.filters(dl.subscriber); !known || len(fromSubject) < 3 || fromSubject[1] != dl.subscriber {
			orphans = append(orphans, fmt.Sprintf("dead letter %d on %s claims subscriber %q", dl.seq, dl.subject, dl.subscriber))
			continue
		}
		kind, ok := r.plantedLetter(dl)
		if !ok {
			unexpected = append(unexpected, fmt.Sprintf("%s: event %d %s: %s", dl.subscriber, dl.id, dl.typ, dl.reason))
			kind = "NOT PLANTED: " + truncate(dl.reason, 60)
		}
		if rep.DeadLetters[dl.subscriber] == nil {
			rep.DeadLetters[dl.subscriber] = map[string]int{}
		}
		rep.DeadLetters[dl.subscriber][kind]++
		if got[dl.subscriber] == nil {
			got[dl.subscriber] = map[int64]bool{}
		}
		got[dl.subscriber][dl.id] = true
	}
	if len(orphans) > 0 {
		rep.violate("5 (every dead letter names its subscriber)", head(orphans))
	}
	if len(unexpected) > 0 {
		rep.violate("7 (only planted events dead-lettered; an outage adds none)", head(unexpected))
	}
	var absent []string
	for subscriber, want := range p.letters {
		for id, l := range want {
			if got[subscriber][id] {
				continue
			}
			if l.product != 0 {
				// A rejected product the load deleted before the indexer
				// reached its event is indexed as gone, rightly: the event
				// is in the checkpoint (checkDelivered requires it).
				var exists bool
				if err := r.pool().QueryRow(ctx, `SELECT EXISTS (SELECT FROM products WHERE id = $1)`, l.product).Scan(&exists); err != nil {
					rep.violate("5 (read the planted product "+strconv.FormatInt(l.product, 10)+")", err.Error())
					continue
				}
				if !exists {
					rep.PlantedDeleted++
					continue
				}
			}
			absent = append(absent, fmt.Sprintf("%s: event %d (%s)", subscriber, id, l.kind))
		}
	}
	if len(absent) > 0 {
		slices.Sort(absent)
		rep.violate("5 (every planted input reaches the dead letters)", head(absent))
	}
}

// plantedLetter names the planted input a dead letter answers, if any: the
// same event and the reason the planting expects, or, for the search
// indexer, any event about a product the mapping rejects (a rename of its
// brand or category reindexes it) with the engine's rejection as the
// reason.
func (r *run) plantedLetter(dl deadLetter) (kind string, ok bool) {
	p := r.planted
	p.mu.Lock()
	defer p.mu.Unlock()
	if want, ok := p.letters[dl.subscriber][dl.id]; ok && strings.Contains(dl.reason, want.reason) {
		return want.kind, true
	}
	if dl.subscriber != searchindex.Name || !strings.Contains(dl.reason, "rejected by index") {
		return "", false
	}
	var body struct {
		ProductID  int64 `json:"product_id"`
		BrandID    int64 `json:"brand_id"`
		CategoryID int64 `json:"category_id"`
	}
	_ = json.Unmarshal(dl.body, &body)
	for id := range p.rejectedProds {
		mentioned := strings.Contains(dl.reason, "document "+strconv.FormatInt(id, 10)+" rejected")
		if mentioned && (body.ProductID == id ||
			(dl.typ == shop.BrandUpdated && p.rejectedBrands[body.BrandID]) ||
			(dl.typ == shop.CategoryUpdated && p.rejectedCats[body.CategoryID])) {
			return plantedRejected, true
		}
	}
	return "", false
}

// checkDelivered: every event in the stream for a subscriber's filter is in
// its checkpoint or its dead letters.
func (r *run) checkDelivered(ctx context.Context, stream *streamContents, dead []deadLetter) {
	rep := r.report
	deadIDs := map[string]map[int64]bool{}
	for _, dl := range dead {
		if deadIDs[dl.subscriber] == nil {
			deadIDs[dl.subscriber] = map[int64]bool{}
		}
		deadIDs[dl.subscriber][dl.id] = true
	}
	for _, name := range r.subscriberNames() {
		rows, err := r.pool().Query(ctx, `SELECT event_id FROM processed_events WHERE subscriber = $1`, name)
		if err != nil {
			rep.violate("1 (read the checkpoint of "+name+")", err.Error())
			continue
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			rep.violate("1 (read the checkpoint of "+name+")", err.Error())
			continue
		}
		done := make(map[int64]bool, len(ids))
		for _, id := range ids {
			done[id] = true
		}
		var missing []string
		wanted := 0
		for _, ev := range stream.bySeq {
			if filters, _ := r.filters(name); !matchesAny(filters, strings.TrimPrefix(ev.subj, "events.")) {
				continue
			}
			wanted++
			if !done[ev.id] && !deadIDs[name][ev.id] {
				missing = append(missing, strconv.FormatInt(ev.id, 10))
			}
		}
		if wanted == 0 {
			rep.violate("1 ("+name+")", "no event in the stream matches its filters: the check proves nothing")
		}
		if len(missing) > 0 {
			rep.violate("1 (every event checkpointed or dead-lettered)", fmt.Sprintf("%s: %d of %d events neither: %s", name, len(missing), wanted, head(missing)))
		}
	}
}

// checkInvoices: exactly one invoice per order (but the planted order with
// a missing product, which has none), none for a rolled-back order.
func (r *run) checkInvoices(ctx context.Context) {
	rep, p := r.report, r.planted
	rows, err := r.pool().Query(ctx, `
SELECT o.id, count(DISTINCT i.id), bool_or(l.product_id = $1 AND l.sku IS NULL)
FROM orders o
LEFT JOIN invoices i ON i.order_id = o.id
LEFT JOIN order_lines l ON l.order_id = o.id
GROUP BY o.id`, missingProduct)
	if err != nil {
		rep.violate("2 (read the invoices)", err.Error())
		return
	}
	var wrong []string
	var id, n int64
	var plantedBad bool
	orders := 0
	_, err = pgx.ForEachRow(rows, []any{&id, &n, &plantedBad}, func() error {
		orders++
		if want := map[bool]int64{true: 0, false: 1}[plantedBad]; n != want {
			wrong = append(wrong, fmt.Sprintf("order %d has %d invoices, want %d", id, n, want))
		}
		return nil
	})
	if err != nil {
		rep.violate("2 (read the invoices)", err.Error())
		return
	}
	if orders == 0 {
		rep.violate("2 (invoices)", "no orders: the check proves nothing")
	}
	if len(wrong) > 0 {
		rep.violate("2 (exactly one invoice per order)", head(wrong))
	}
	var ghost int
	if err := r.pool().QueryRow(ctx, `SELECT count(*) FROM invoices WHERE order_id = ANY($1)`, p.rolledBack).Scan(&ghost); err != nil {
		rep.violate("4 (read the invoices)", err.Error())
	} else if ghost > 0 {
		rep.violate("4 (no invoice for rolled-back orders)", fmt.Sprintf("%d invoices for orders %v", ghost, p.rolledBack))
	}
}

// checkLedger: each product's sales ledger equals the sum of the lines of
// its committed orders. The ledger adds up, so an event handled twice (or
// lost) shows here even where a unique key would hide it.
func (r *run) checkLedger(ctx context.Context) {
	rep := r.report
	drift, err := salesledger.Drift(ctx, r.pool())
	if err != nil {
		rep.violate("2 (read the "+salesledger.Name+")", err.Error())
		return
	}
	if len(drift) > 0 {
		rep.violate("2 (each product's sales ledger equals its order lines: every order counted once)", head(drift))
	}
	var products int
	if err := r.pool().QueryRow(ctx, `SELECT count(*) FROM product_sales`).Scan(&products); err != nil || products == 0 {
		rep.violate("2 ("+salesledger.Name+")", fmt.Sprintf("an empty ledger (%v): the check proves nothing", err))
	}
}

// checkFulfilment: the ordered subscriber applied every order's
// transitions as they were committed, one at a time and in order, across
// its instances' crashes and the pin moving between them: its history
// equals order_transitions, and it recorded no violation (out of order,
// after a gap, after the order ended).
func (r *run) checkFulfilment(ctx context.Context) {
	if !slices.Contains(r.subscriberNames(), fulfilment.Name) {
		return
	}
	rep := r.report
	diffs, err := fulfilment.Compare(ctx, r.pool(), 10)
	if err != nil {
		rep.violate("8 (read "+fulfilment.Name+")", err.Error())
		return
	}
	if len(diffs) > 0 {
		rep.violate("8 (every order's applied history equals its committed history, no violation recorded)", head(diffs))
	}
	var moved int
	if err := r.pool().QueryRow(ctx, `SELECT count(*) FROM fulfilment_history WHERE n > 1`).Scan(&moved); err != nil || moved == 0 {
		rep.violate("8 ("+fulfilment.Name+")", fmt.Sprintf("no order moved past created (%v): the check proves nothing", err))
	}
	rep.Transitions = moved
}

// checkSearch: every search document equals its SQL join; no deleted
// product has one. The planted rejected products are, rightly, missing.
func (r *run) checkSearch(ctx context.Context) {
	rep, p := r.report, r.planted
	cur, err := searchindex.Current(ctx, r.search, r.alias)
	if err != nil || cur == "" {
		rep.violate("3 (search)", fmt.Sprintf("no index behind %s: %v", r.alias, err))
		return
	}
	if err := r.search.Refresh(ctx, cur); err != nil {
		rep.violate("3 (search)", err.Error())
		return
	}
	d, err := searchindex.Check(ctx, r.search, r.pool(), cur, 0)
	if err != nil {
		rep.violate("3 (search)", err.Error())
		return
	}
	var missing []int64
	for _, id := range d.Missing {
		if !p.rejectedProds[id] {
			missing = append(missing, id)
		}
	}
	if len(missing)+len(d.Different)+len(d.Extra) > 0 {
		rep.violate("3 (every document equals SQL, no deleted product indexed)",
			fmt.Sprintf("missing %v, different %v, deleted but indexed %v", cut(missing), cut(d.Different), cut(d.Extra)))
	}
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
		case err != nil:
			stale = append(stale, fmt.Sprintf("product %d: %v", id, err))
		case cached < current:
			stale = append(stale, fmt.Sprintf("product %d cached at version %d, SQL has %d", id, cached, current))
		}
	}
	if err := iter.Err(); err != nil {
		r.report.violate("3 (read the cache)", err.Error())
	}
	if len(stale) > 0 {
		r.report.violate("3 (no cached product older than SQL)", head(stale))
	}
}

// matchesAny reports whether subject matches one of the NATS subject
// patterns.
func matchesAny(patterns []string, subject string) bool {
	return slices.ContainsFunc(patterns, func(p string) bool { return subscribers.SubjectMatches(p, subject) })
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

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
