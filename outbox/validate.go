package outbox

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/fanout/fanout/stream"
)

// Limits on what an event carries. Each keeps its part of the NATS message
// inside what nats-server and JetStream accept, with room to spare, so that
// an event the writer accepts can always be published, and the relay (which
// applies the same rules to rows written behind this package's back) never
// sends something the server answers by dropping the connection.
const (
	// MaxEventTypeLen bounds Event.Type, in bytes. The subject
	// <prefix>.<type> travels in the publish's control line, which the
	// server caps at max_control_line (4096 bytes by default); a longer one
	// makes the server close the connection, and nats.go then closes it for
	// good rather than reconnecting. 255 leaves the rest of the line (the
	// prefix, the reply inbox, the sizes) far below the cap.
	MaxEventTypeLen = 255
	// MaxAggregateLen bounds AggregateType and AggregateID, in bytes; both
	// travel as header values.
	MaxAggregateLen = 1024
	// MaxHeadersSize bounds Event.Headers, counted as on the wire: the name,
	// ": ", the value and CRLF for each. JetStream refuses a message whose
	// header block exceeds 64 KiB; the other half is left for the headers
	// the relay and NATS add.
	MaxHeadersSize = 32 << 10
)

// ValidEventType returns an error wrapping ErrInvalidEvent unless t is one or
// more dot-separated valid subject tokens ("product.updated"), valid UTF-8
// and at most MaxEventTypeLen bytes long.
func ValidEventType(t string) error {
	if t == "" {
		return fmt.Errorf("%w: empty event type", ErrInvalidEvent)
	}
	if len(t) > MaxEventTypeLen {
		return fmt.Errorf("%w: event type %s is %d bytes long, over the limit of %d (the subject must fit the server's max_control_line)",
			ErrInvalidEvent, clip(t), len(t), MaxEventTypeLen)
	}
	if !utf8.ValidString(t) {
		return fmt.Errorf("%w: event type %s is not valid UTF-8", ErrInvalidEvent, clip(t))
	}
	for tok := range strings.SplitSeq(t, ".") {
		if !stream.ValidSubjectToken(tok) {
			return fmt.Errorf("%w: event type %s: each dot-separated token must be non-empty, printable, without spaces, '*' or '>'", ErrInvalidEvent, clip(t))
		}
	}
	return nil
}

// ValidateAggregate returns an error wrapping ErrInvalidEvent unless both
// the aggregate type and id are non-empty, at most MaxAggregateLen bytes
// long, and valid header values (see ValidateHeaders): the relay sends them
// as the Fanout-Aggregate-Type and Fanout-Aggregate-Id headers.
func ValidateAggregate(aggregateType, aggregateID string) error {
	if aggregateType == "" || aggregateID == "" {
		return fmt.Errorf("%w: an event needs an aggregate type and id (got %s and %s)", ErrInvalidEvent, clip(aggregateType), clip(aggregateID))
	}
	for _, f := range [...]struct{ what, v string }{{"aggregate type", aggregateType}, {"aggregate id", aggregateID}} {
		if len(f.v) > MaxAggregateLen {
			return fmt.Errorf("%w: %s %s is %d bytes long, over the limit of %d", ErrInvalidEvent, f.what, clip(f.v), len(f.v), MaxAggregateLen)
		}
		if problem := headerValueProblem(f.v); problem != "" {
			return fmt.Errorf("%w: %s %s: %s", ErrInvalidEvent, f.what, clip(f.v), problem)
		}
	}
	return nil
}

// ValidateHeaders returns an error wrapping ErrInvalidEvent unless every
// header can travel through NATS unchanged and without changing what
// JetStream does with the message:
//
//   - a name is an HTTP token (RFC 7230: letters, digits and
//     !#$%&'*+-.^_`|~), which is also what nats.go accepts;
//   - a name does not start with "Nats-" (in any case): JetStream acts on
//     those (Nats-Msg-Id, Nats-Expected-Last-Sequence, Nats-TTL,
//     Nats-Rollup, ...), and the relay sets the ones it needs itself;
//   - a name does not start with "Fanout-" (in any case): the relay and the
//     subscribers set those, and subscribers trust them;
//   - a value is valid UTF-8 without control characters other than tab
//     (CR or LF would end the header line; nats.go replaces them with
//     spaces) and without leading or trailing spaces or tabs (NATS clients
//     trim them);
//   - all headers together are at most MaxHeadersSize bytes on the wire.
//
// When several headers are invalid, the error names the first by name, so
// that it is the same every time.
func ValidateHeaders(headers map[string]string) error {
	size := 0
	for k, v := range headers {
		if headerProblem(k, v) != "" {
			return firstHeaderError(headers)
		}
		size += len(k) + len(v) + len(": \r\n")
	}
	if size > MaxHeadersSize {
		return fmt.Errorf("%w: headers are %d bytes on the wire, over the limit of %d", ErrInvalidEvent, size, MaxHeadersSize)
	}
	return nil
}

// firstHeaderError is ValidateHeaders' slow path: it sorts the names (which
// allocates) only once some header is known to be invalid.
func firstHeaderError(headers map[string]string) error {
	names := make([]string, 0, len(headers))
	for k := range headers {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		if problem := headerProblem(k, headers[k]); problem != "" {
			return fmt.Errorf("%w: %s", ErrInvalidEvent, problem)
		}
	}
	return nil
}

// headerProblem describes what is wrong with one header, or returns "".
func headerProblem(name, value string) string {
	if name == "" {
		return "empty header name"
	}
	for i := 0; i < len(name); i++ {
		if !isTokenChar[name[i]] {
			return fmt.Sprintf("header name %s: %s at offset %d is not allowed: names are HTTP tokens (RFC 7230: ASCII letters, digits and !#$%%&'*+-.^_`|~)",
				clip(name), describeByte(name[i]), i)
		}
	}
	if hasPrefixFold(name, "Nats-") {
		return fmt.Sprintf("header name %s: the Nats- prefix is reserved for NATS and JetStream, which act on such headers", clip(name))
	}
	if hasPrefixFold(name, "Fanout-") {
		return fmt.Sprintf("header name %s: the Fanout- prefix is reserved for the headers fanout sets itself", clip(name))
	}
	if problem := headerValueProblem(value); problem != "" {
		return fmt.Sprintf("header %s: value %s: %s", clip(name), clip(value), problem)
	}
	return ""
}

// headerValueProblem describes why v cannot be a header value, or returns "".
func headerValueProblem(v string) string {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return fmt.Sprintf("control character %s at offset %d (only tab is allowed: CR or LF would end the header line)", describeByte(c), i)
		}
	}
	if v != "" && (isSpaceOrTab(v[0]) || isSpaceOrTab(v[len(v)-1])) {
		return "leading or trailing whitespace, which NATS clients trim"
	}
	if !utf8.ValidString(v) {
		return "not valid UTF-8"
	}
	return ""
}

// describeByte shows c as a character when it is ASCII, as a number when it
// is part of a multi-byte UTF-8 sequence.
func describeByte(c byte) string {
	if c >= utf8.RuneSelf {
		return fmt.Sprintf("non-ASCII byte %#x", c)
	}
	return strconv.QuoteRune(rune(c))
}

func isSpaceOrTab(c byte) bool { return c == ' ' || c == '\t' }

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

// isTokenChar holds RFC 7230's tchar: visible ASCII except the delimiters
// "(),/:;<=>?@[\]{} and DQUOTE. nats.go accepts exactly these in header names.
var isTokenChar = func() (t [256]bool) {
	for c := byte('!'); c <= '~'; c++ {
		t[c] = !strings.ContainsRune(`"(),/:;<=>?@[\]{}`, rune(c))
	}
	return t
}()

// clip quotes s for an error message, cut to its first 64 bytes: a reason
// names the value, it need not repeat a long one. Quoted, the message is one
// printable line of valid UTF-8 whatever s holds, fit for a log line and for
// the relay's last_error (a text column, which could not store a NUL).
func clip(s string) string {
	const limit = 64
	if len(s) <= limit {
		return strconv.Quote(s)
	}
	return strconv.Quote(s[:limit]) + "..."
}
