// Package jsretry retries JetStream API calls that fail for a while (a
// request timeout, no responder, a cluster electing its leader): a role
// starting together with its broker should wait for it, not exit.
package jsretry

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Transient reports a JetStream API failure that passes by itself.
func Transient(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	var apiErr *jetstream.APIError
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		(errors.As(err, &apiErr) && (apiErr.Code >= 500 || peerOffline(apiErr)))
}

// errCodeNoPeers is JetStream's "no suitable peers for placement".
const errCodeNoPeers jetstream.ErrorCode = 10005

// peerOffline reports a stream or consumer that cannot be placed only
// because a cluster node is down (restarting, or the cluster still
// forming): it can be once the node is back. Placement refused for any
// other reason (insufficient storage, unmatched tags, more replicas than
// nodes) is a configuration to fix, not a wait.
func peerOffline(e *jetstream.APIError) bool {
	return e.ErrorCode == errCodeNoPeers && e.Description == "no suitable peers for placement, peer offline"
}

// Do runs fn until it succeeds, fails for good, or ctx ends,
// waiting longer after each transient failure: a subscriber starting with
// its cluster waits for it rather than exit.
func Do(ctx context.Context, logger *slog.Logger, what string, fn func() error) error {
	wait := 200 * time.Millisecond
	for {
		err := fn()
		if err == nil || !Transient(ctx, err) {
			return err
		}
		logger.Warn(what+" failed, retrying", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
		wait = min(wait*2, 5*time.Second)
	}
}
