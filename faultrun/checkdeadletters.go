package faultrun

// The dead letters: each names a known subscriber and a planted input,
// and every planted input reached the dead letters it must.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go/jetstream"
)

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
	s, err := r.jsDL.Stream(ctx, "DEADLETTER")
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
		id, _ := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
		out = append(out, deadLetter{seq: seq, subject: m.Subject, subscriber: m.Header.Get(subscribers.DeadSubscriberHeader), id: id,
			typ: m.Header.Get(wire.EventTypeHeader), body: m.Data, reason: m.Header.Get(subscribers.DeadReasonHeader)})
	}
	if uint64(len(out)) != info.State.Msgs {
		return nil, fmt.Errorf("read %d dead letters, the stream reports %d", len(out), info.State.Msgs)
	}
	return out, nil
}

// checkDeadLetters: each dead letter belongs to a known subscriber (by its
// subject and its header alike) and matches a planted input by its reason;
// every planted input that must reach a subscriber's dead letters did.
func (r *run) checkDeadLetters(ctx context.Context, dead []deadLetter, stream *streamContents) {
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
			if seq, ok := stream.seqOf(id); ok && r.missedByLate(subscriber, seq) {
				continue // before the late subscriber joined: the backfill's
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
