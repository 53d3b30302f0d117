package subscribers

import (
	"context"
	"log/slog"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// In the production layout the dead letters live in an account with a
// share of the store of its own (deploy/nats: DEADLETTER's max_file): a
// subscriber writing letters without end fills that share, not the store
// the events need. A full share refuses every subscriber's letters, which
// each takes for an outage of its dead letters (it keeps the event and
// retries). deadLetterShare says so before: it reads the share's use and
// limit (the dead letters' account's JetStream info, through
// subscribers.dead_letter_api_prefix), reports both, and logs a warning
// when the share is 80% full and again when it is no longer.

// shareWarnAt is how full a share is when it is warned of.
const shareWarnAt = 0.8

type deadLetterShare struct {
	js     jetstream.JetStream // the dead letters' account's API
	name   string
	obs    Observer
	logger *slog.Logger
	full   bool // warned of, not yet recovered
}

func newDeadLetterShare(nc *nats.Conn, prefix, name string, obs Observer, logger *slog.Logger) (*deadLetterShare, error) {
	js, err := jetstream.NewWithAPIPrefix(nc, prefix)
	if err != nil {
		return nil, err
	}
	return &deadLetterShare{js: js, name: name, obs: obs, logger: logger}, nil
}

// check reads the share once; a read that gets no answer changes nothing.
func (d *deadLetterShare) check(ctx context.Context) {
	info, err := d.js.AccountInfo(ctx)
	if err != nil {
		d.logger.Debug("dead letters' share: no answer", "error", err)
		return
	}
	used, limit := int64(info.Store), info.Limits.MaxStore
	d.obs.DeadLetterShare(d.name, used, limit)
	if limit <= 0 {
		return // no limit: no share to fill
	}
	full := float64(used) >= shareWarnAt*float64(limit)
	switch {
	case full && !d.full:
		d.logger.Warn("the dead letters' share of the store is filling: when it is full every subscriber's dead letters are refused, and each holds its failing events until an operator discards letters (fanout dlq) or raises the share",
			"used_bytes", used, "limit_bytes", limit)
	case !full && d.full:
		d.logger.Info("the dead letters' share of the store has room again", "used_bytes", used, "limit_bytes", limit)
	}
	d.full = full
}
