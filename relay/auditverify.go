package relay

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go/jetstream"
)

// What the auditor does with what it reads: verify that each event is in
// the stream where it landed, confirm what seems missing with the
// stream's leader, and repair what is missing indeed from its row.

// auditGap is the widest gap between two audited sequences read through
// rather than asked for apart.
const auditGap = 256

// verify checks that each event of ls is in the stream at its sequence
// with its identity (sequence 0: no landing recorded, missing), and with
// repair publishes again those that are not. An event whose row's content
// is in contents must also hold it there (its subject and payload), or it
// is altered: a message published under its identity with other content,
// which JetStream kept in place of the relay's as a duplicate, and which
// no repair can replace (the subscribers took it for the event).
func (a *auditor) verify(ctx context.Context, ls []outboxstore.Landed, contents map[int64]outboxstore.ContentDigest, repair bool) (AuditReport, error) {
	rep := AuditReport{Checked: int64(len(ls))}
	if len(ls) == 0 {
		return rep, nil
	}
	// The identity as the database has it now: a relay that has not
	// published since another began an epoch holds an older one.
	ident, err := a.store.ReadIdentity(ctx)
	if err != nil {
		return rep, err
	}
	pairs := newestLandings(ls)
	rep.Checked = int64(len(pairs))
	suspects, err := a.suspects(ctx, ident, pairs, contents, &rep)
	if err != nil || len(suspects) == 0 {
		return rep, err
	}
	missing, err := a.confirmMissing(ctx, ident, suspects)
	if err != nil {
		return rep, err
	}
	rep.Missing = int64(len(missing))
	if len(missing) == 0 || !repair {
		return rep, nil
	}
	// A repair publishes, as the relay does: not into a stream another
	// database owns or that holds an epoch this database does not know,
	// and with the identity a due restore check may have just changed.
	if err := a.origin.guard(ctx); err != nil {
		return rep, fmt.Errorf("not publishing the %d missing events again: %w", len(missing), err)
	}
	repaired, lost, err := a.repair(ctx, a.origin.identity.Load(), missing)
	rep.Repaired, rep.Lost = int64(repaired), lost
	return rep, err
}

// newestLandings keeps the newest landing of each event (ls are in
// landing order), in the order of their sequences.
func newestLandings(ls []outboxstore.Landed) []outboxstore.Landed {
	newest := make(map[int64]int, len(ls))
	for i, l := range ls {
		newest[l.ID] = i
	}
	pairs := make([]outboxstore.Landed, 0, len(newest))
	for i, l := range ls {
		if newest[l.ID] == i {
			pairs = append(pairs, l)
		}
	}
	slices.SortFunc(pairs, func(x, y outboxstore.Landed) int { return cmpSeq(x.Seq, y.Seq) })
	return pairs
}

// suspects reads the stream at the sequences of pairs (in order), runs of
// them at a time, and returns the events not found with their identity
// where they landed, or with no landing recorded; rep counts those, the
// events below the stream's first sequence, and those found altered.
func (a *auditor) suspects(ctx context.Context, ident *outbox.Identity, pairs []outboxstore.Landed, contents map[int64]outboxstore.ContentDigest, rep *AuditReport) ([]outboxstore.Landed, error) {
	s, err := a.js.Stream(ctx, a.stream.Name)
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", a.stream.Name, err)
	}
	var suspects []outboxstore.Landed
	i := 0
	for i < len(pairs) && pairs[i].Seq == 0 {
		suspects = append(suspects, pairs[i])
		rep.Unrecorded++
		i++
	}
	// Below the stream's first sequence: removed by the stream's own
	// limits (max_age, max_bytes); missing only if a consumer had not
	// acknowledged them (auditaged.go).
	first := s.CachedInfo().State.FirstSeq
	aged := i
	for i < len(pairs) && pairs[i].Seq < first {
		i++
	}
	unconsumed, err := a.unconsumed(ctx, s, pairs[aged:i])
	if err != nil {
		return nil, err
	}
	rep.AgedOut += int64(i - aged - len(unconsumed))
	rep.AgedUnconsumed += int64(len(unconsumed))
	suspects = append(suspects, unconsumed...)
	for i < len(pairs) {
		// One run: sequences no more than auditGap apart, read through.
		j := i + 1
		for j < len(pairs) && pairs[j].Seq-pairs[j-1].Seq <= auditGap {
			j++
		}
		run := pairs[i:j]
		k := 0
		err := readRange(ctx, a.js, s, a.consumer, a.stream.Provision == "auto", a.consumerRead, run[0].Seq, run[len(run)-1].Seq, func(m *jetstream.RawStreamMsg) bool {
			for k < len(run) && run[k].Seq < m.Sequence {
				suspects = append(suspects, run[k]) // no message at its sequence
				k++
			}
			for k < len(run) && run[k].Seq == m.Sequence {
				switch {
				case m.Header.Get(jetstream.MsgIDHeader) != wire.MsgID(ident.OriginOf(run[k].ID), run[k].ID):
					suspects = append(suspects, run[k])
				case contents != nil:
					a.checkContent(m, run[k].ID, contents, rep)
				}
				k++
			}
			return k < len(run)
		})
		if err != nil {
			return nil, err
		}
		suspects = append(suspects, run[k:]...)
		i = j
	}
	return suspects, nil
}

func cmpSeq(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// confirmMissing keeps the suspects that are missing indeed: not at their
// sequence as the stream's leader sees it (a replica a direct get reached
// may be behind), nor where they landed last (published again since).
func (a *auditor) confirmMissing(ctx context.Context, ident *outbox.Identity, suspects []outboxstore.Landed) ([]outboxstore.Landed, error) {
	ids := make([]int64, len(suspects))
	for i, l := range suspects {
		ids[i] = l.ID
	}
	latest, err := a.store.NewestLandings(ctx, a.stream.Name, ids)
	if err != nil {
		return nil, err
	}
	// What the leader holds: a sequence past its last one is missing
	// without asking (after a rollback, most of them are).
	s, err := a.js.Stream(ctx, a.stream.Name)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	leaderLast := info.State.LastSeq
	var missing []outboxstore.Landed
	for _, l := range suspects {
		seqs := []uint64{l.Seq}
		if last := latest[l.ID]; last != l.Seq {
			seqs = append(seqs, last)
		}
		found := false
		for _, seq := range seqs {
			if seq == 0 || seq > leaderLast {
				continue
			}
			m, ok, err := leaderGet(ctx, a.nc, a.stream.Name, seq)
			if err != nil {
				return nil, err
			}
			if ok && m.Header.Get(jetstream.MsgIDHeader) == wire.MsgID(ident.OriginOf(l.ID), l.ID) {
				found = true
				break
			}
		}
		if !found {
			missing = append(missing, l)
		}
	}
	return missing, nil
}

// repair publishes the missing events again from their rows, with their
// identity, and records where they landed. Rows gone too are lost.
func (a *auditor) repair(ctx context.Context, ident *outbox.Identity, missing []outboxstore.Landed) (repaired int, lost []int64, err error) {
	was := make(map[int64]uint64, len(missing))
	for _, l := range missing {
		was[l.ID] = l.Seq
	}
	maxPayload := a.nc.MaxPayload()
	// An event the stream's limits removed within its duplicate window is
	// dropped as a duplicate of itself: JetStream answers with the
	// sequence it had. Not repaired until the window has passed.
	s, err := a.js.Stream(ctx, a.stream.Name)
	if err != nil {
		return 0, nil, fmt.Errorf("look up stream %s: %w", a.stream.Name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, nil, fmt.Errorf("look up stream %s: %w", a.stream.Name, err)
	}
	first := info.State.FirstSeq
	for len(missing) > 0 {
		part := missing[:min(len(missing), a.cfg.BatchSize)]
		missing = missing[len(part):]
		ids := make([]int64, len(part))
		for i, l := range part {
			ids[i] = l.ID
		}
		chunk, err := a.store.Rows(ctx, ids)
		if err != nil {
			return repaired, lost, err
		}
		have := make(map[int64]bool, len(chunk))
		for _, rw := range chunk {
			have[rw.ID] = true
		}
		for _, id := range ids {
			if !have[id] {
				lost = append(lost, id)
				a.logger.Error("audit: an event is missing from the stream and its outbox row is gone: it cannot be published again",
					"event_id", id, "stream_seq", was[id])
			}
		}
		futures := make([]jetstream.PubAckFuture, len(chunk))
		for i, rw := range chunk {
			msg, err := wire.Encode(a.stream, ident, rw, maxPayload)
			if err != nil {
				a.logger.Error("audit: an event missing from the stream cannot be published again", "event_id", rw.ID, "error", err)
				continue
			}
			msg.Header[wire.RepairedHeader] = []string{strconv.FormatUint(was[rw.ID], 10)}
			if futures[i], err = a.js.PublishMsgAsync(msg); err != nil {
				return repaired, lost, fmt.Errorf("publish event %d again: %w", rw.ID, err)
			}
		}
		var landed []outboxstore.Landed
		for i, f := range futures {
			if f == nil {
				continue
			}
			select {
			case ack := <-f.Ok():
				if ack.Duplicate && ack.Sequence < first {
					a.logger.Error("audit: an event the stream's limits removed cannot be published again within the stream's duplicate window: the next audit after it tries again",
						"event_id", chunk[i].ID, "stream_seq", was[chunk[i].ID], "duplicate_window", info.Config.Duplicates)
					continue
				}
				landed = append(landed, outboxstore.Landed{ID: chunk[i].ID, Seq: ack.Sequence})
				a.logger.Warn("audit: an event was missing from the stream: published again",
					"event_id", chunk[i].ID, "stream_seq", was[chunk[i].ID], "new_stream_seq", ack.Sequence, "duplicate", ack.Duplicate)
			case err := <-f.Err():
				return repaired, lost, fmt.Errorf("publish event %d again: %w", chunk[i].ID, err)
			case <-ctx.Done():
				return repaired, lost, ctx.Err()
			}
		}
		if err := a.store.RecordLandings(ctx, a.stream.Name, landed); err != nil {
			return repaired, lost, err
		}
		repaired += len(landed)
	}
	if len(lost) > maxLostListed {
		lost = lost[:maxLostListed]
	}
	return repaired, lost, nil
}
