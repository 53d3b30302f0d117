package subscribers

// What an error says: whether a handler's failure is the event's fault,
// an outage, or the company it met.

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
)

// Outcome is what became of a handler's attempt on an event, as the
// runtime judges it (Health.Judge judges a failure): the live runtime and
// the backfill act on it alike.
type Outcome int

const (
	OutcomeDone      Outcome = iota // effect and checkpoint committed
	OutcomeFailed                   // the handler failed on the event: counted towards max_failures
	OutcomePermanent                // the handler says never (Permanent): the dead letters
	OutcomeSnooze                   // RetryAfter: again after its delay, not counted
	OutcomeRetry                    // a connection broke or a transaction conflicted: again, not counted
	OutcomeOutage                   // a dependency is down: hold the event
	OutcomeAbandoned                // stopping: leave it (it is redelivered)
)

// Judge classifies err, a failed attempt of a handler, for the live
// runtime and the backfill alike. A dependency that is down is never the
// event's fault: if the handler did not name one (Unavailable), the
// dependencies are probed before the failure is charged to the event.
func (h *Health) Judge(ctx context.Context, err error) Outcome {
	switch {
	case ctx.Err() != nil:
		return OutcomeAbandoned
	case IsPermanent(err):
		return OutcomePermanent
	}
	if dep, ok := IsUnavailable(err); ok {
		h.MarkDown(dep, err)
		return OutcomeOutage
	}
	if _, ok := retryDelay(err); ok {
		return OutcomeSnooze
	}
	if errors.Is(err, errOutOfTurn) {
		return OutcomeRetry
	}
	if h.ProbeAll(ctx) {
		return OutcomeOutage
	}
	if IsConnectionFailure(err) || IsConflict(err) {
		return OutcomeRetry
	}
	return OutcomeFailed
}

// IsConnectionFailure reports whether err says a connection to some dependency
// failed, rather than anything about the event: the runtime never counts
// such a failure against the event.
//
// A context deadline is not connectivity: a handler that ran out of
// subscribers.handler_timeout may be hanging on this very event (the
// runtime then probes the dependencies to tell a hang from an outage).
func IsConnectionFailure(err error) bool {
	if err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return postgresUnavailable(pgErr.Code)
	}
	if pgconn.SafeToRetry(err) {
		// pgx says nothing reached the server: the connection was gone.
		return true
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	// pgx reports a connection it closed after a failure this way.
	return strings.Contains(err.Error(), "conn closed")
}

// postgresUnavailable reports whether a Postgres error code says the
// server cannot serve anyone right now (it is starting, shutting down,
// read-only after a failover, out of connections or resources), as opposed
// to refusing this statement.
func postgresUnavailable(code string) bool {
	switch {
	case strings.HasPrefix(code, "08"): // connection exception
		return true
	case strings.HasPrefix(code, "53"): // insufficient resources: too many connections, disk full, out of memory
		return true
	case strings.HasPrefix(code, "58"): // system error, I/O error
		return true
	}
	switch code {
	case "57P01", "57P02", "57P03": // admin shutdown, crash shutdown, cannot connect now (starting up)
		return true
	case "25006": // read-only transaction: a standby, or a primary demoted in a failover
		return true
	}
	return false
}

// IsConflict reports whether err is Postgres aborting the transaction for a
// concurrent one (a serialization failure, a deadlock): the next attempt
// meets different company, and the event is not at fault.
func IsConflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}
