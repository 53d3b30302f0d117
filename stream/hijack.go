package stream

import (
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// A consumer can be turned against another role's: made as a push
// consumer whose delivery subject is the JetStream API (a subscriber's
// CONSUMER.RESET or MSG.NEXT), an event's body becomes a request that
// moves or drains that subscriber; moved past the stream's last message
// (a reset to a sequence not yet written), a subscriber's consumer skips
// every event up to there in silence and reports nothing pending. Only
// `fanout provision` and the stream's administrator can make such a
// consumer in the production layout; these marks find one all the same,
// whoever made it (HijackMarks).

// hijackPrefixes are the delivery subjects that act on the server: the
// JetStream API, acks and flow control, the key-value and object stores,
// and the system account.
var hijackPrefixes = []string{"$JS.", "$KV.", "$O.", "$SYS."}

// HijackMarks lists what marks info, a consumer of a stream whose events'
// subjects start with subjectPrefix, as turned against another: a
// delivery subject into the server's API or into the stream's own
// subjects. A push consumer delivering to an inbox (the nats CLI's views)
// bears no mark. The other mark, a position past the stream's end, is
// PastTheEndWatch's.
func HijackMarks(info *jetstream.ConsumerInfo, subjectPrefix string) []Difference {
	d := info.Config.DeliverSubject
	if d == "" {
		return nil
	}
	into := ""
	for _, p := range hijackPrefixes {
		if strings.HasPrefix(d, p) {
			into = "the server's API"
		}
	}
	if SubjectMatches(subjectPrefix+".>", d) {
		into = "the stream's own subjects"
	}
	if into == "" {
		return nil
	}
	return []Difference{{Field: "deliver_subject", Have: d, Want: "none into " + into + " (a message delivered there acts on another consumer or stream)"}}
}

// PastTheEnd is the mark of a consumer whose position is past lastSeq,
// the stream's last sequence read after info: moved there (a reset), it
// skips every event written up to there.
func PastTheEnd(info *jetstream.ConsumerInfo, lastSeq uint64) []Difference {
	if pos := max(info.Delivered.Stream, info.AckFloor.Stream); pos > lastSeq {
		// Want names no sequence: the stream's grows, and a difference
		// that changes at every check would be logged at every check.
		return []Difference{{Field: "delivered.stream_seq", Have: fmt.Sprint(pos),
			Want: "at most the stream's last sequence (moved past it, a consumer skips every event written up to there)"}}
	}
	return nil
}

// PastTheEndWatch marks a consumer past the stream's end only once two
// checks in a row found it there. In a cluster a consumer's position and
// the stream's last sequence are answered by their own leaders, and for a
// moment after an election one may be behind the other; a consumer moved
// past the end stays there. Used from one loop only.
type PastTheEndWatch struct {
	seen  map[string]bool         // past the end at the last round
	marks map[string][]Difference // what the last round reported
}

// Round checks each consumer in infos against lastSeq, the stream's last
// sequence read after them, and returns the marks of those past the end
// at this round and the one before. A consumer not in infos is forgotten.
func (w *PastTheEndWatch) Round(infos []*jetstream.ConsumerInfo, lastSeq uint64) map[string][]Difference {
	seen, marks := map[string]bool{}, map[string][]Difference{}
	for _, info := range infos {
		ds := PastTheEnd(info, lastSeq)
		if len(ds) == 0 {
			continue
		}
		seen[info.Name] = true
		if w.seen[info.Name] {
			marks[info.Name] = ds
		}
	}
	w.seen, w.marks = seen, marks
	return marks
}

// Held is what the last round reported for consumer name: for a check
// that read the consumer but not the stream, which neither raises nor
// clears the mark.
func (w *PastTheEndWatch) Held(name string) []Difference {
	return w.marks[name]
}
