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
// subjects start with subjectPrefix and whose last sequence is lastSeq
// (read after info), as turned against another: a delivery subject into
// the server's API or into the stream's own subjects, or a position past
// the stream's last message. A push consumer delivering to an inbox (the
// nats CLI's views) bears no mark.
func HijackMarks(info *jetstream.ConsumerInfo, subjectPrefix string, lastSeq uint64) []Difference {
	var ds []Difference
	if d := info.Config.DeliverSubject; d != "" {
		into := ""
		for _, p := range hijackPrefixes {
			if strings.HasPrefix(d, p) {
				into = "the server's API"
			}
		}
		if SubjectMatches(subjectPrefix+".>", d) {
			into = "the stream's own subjects"
		}
		if into != "" {
			ds = append(ds, Difference{Field: "deliver_subject", Have: d, Want: "none into " + into + " (a message delivered there acts on another consumer or stream)"})
		}
	}
	return append(ds, PastTheEnd(info, lastSeq)...)
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
