package relay

// The range audit's content check: a message under an event's identity
// must hold what the event's row holds (see verify).

import (
	"github.com/fanout/fanout/outboxstore"
	"github.com/nats-io/nats.go/jetstream"
)

// checkContent compares message m, event id's in the stream, with what
// its row says it holds, and counts and logs it altered if it differs.
func (a *auditor) checkContent(m *jetstream.RawStreamMsg, id int64, contents map[int64]outboxstore.ContentDigest, rep *AuditReport) {
	want, ok := contents[id]
	if !ok || outboxstore.ContentOf(m.Subject, m.Data) == want {
		return
	}
	rep.Altered++
	if len(rep.AlteredIDs) < maxLostListed {
		rep.AlteredIDs = append(rep.AlteredIDs, id)
	}
	a.logger.Error("audit: an event in the stream does not hold what its outbox row holds: a message published under its identity with other content took its place, and its subscribers took that for the event; no repair can replace it",
		"event_id", id, "stream_seq", m.Sequence, "subject", m.Subject)
}
