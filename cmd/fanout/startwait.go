package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/search"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
)

// waitForDependency runs call until it succeeds, fails for a reason that
// waiting will not mend, or ctx ends. A role starting beside a dependency
// that is down or slow to answer its first call (a search engine creating
// its first index under load, a Redis restarting) waits for it, as it
// would wait through the same outage once running, rather than exit; each
// failed try is logged naming the dependency and the call, so a role that
// never comes up says why.
func waitForDependency(ctx context.Context, logger *slog.Logger, dependency, call string, fn func() error) error {
	tries := 0
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		tries++
		err := fn()
		if err != nil && !outage(err) {
			return struct{}{}, backoff.Permanent(err)
		}
		return struct{}{}, err
	},
		backoff.WithBackOff(&backoff.ExponentialBackOff{InitialInterval: 250 * time.Millisecond, RandomizationFactor: 0.2,
			Multiplier: 2, MaxInterval: 5 * time.Second}),
		backoff.WithMaxElapsedTime(0), // an outage of any length
		backoff.WithNotify(func(err error, next time.Duration) {
			logger.Warn("waiting for "+dependency+" to start", "call", call, "error", err, "tries", tries, "retry_in", next.Round(time.Millisecond))
		}))
	if err != nil && tries > 1 && ctx.Err() == nil {
		logger.Error("gave up waiting for "+dependency, "call", call, "error", err, "tries", tries)
	}
	return err
}

// outage reports an error that a dependency being down or overloaded
// explains: no connection, a timeout, a connection cut, the search engine
// answering 5xx or 429, Postgres starting, stopping or out of
// connections, no NATS server answering, or one too slow to finish a
// login. Anything else (a refused credential, a mapping the engine
// rejects, a setting that does not parse) is the configuration's to fix,
// and waiting would only hide it.
func outage(err error) bool {
	var se *search.Error
	if errors.As(err, &se) {
		return se.Status >= 500 || se.Status == 429
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		// 57P01-57P03: shutting down, crashed, starting up; 53300: too
		// many connections.
		return pe.Code == "57P01" || pe.Code == "57P02" || pe.Code == "57P03" || pe.Code == "53300"
	}
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, nats.ErrNoServers) || errors.Is(err, nats.ErrTimeout) ||
		// nats.go's word for a server that sent its first PING before
		// answering the login's (a bcrypt check taking it over 2 s).
		strings.Contains(err.Error(), "expected 'PONG', got 'PING'") ||
		errors.As(err, &ne)
}
