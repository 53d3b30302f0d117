package stream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// JetStreamConfig is the stream that stream.provision=auto creates.
func JetStreamConfig(cfg Config) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name: cfg.Name,
		Description: "fanout: domain events relayed from the Postgres outbox. " +
			"Nats-Msg-Id is the outbox row id; subjects are " + cfg.SubjectPrefix + ".<event_type>.",
		Subjects:   []string{cfg.SubjectPrefix + ".>"},
		Retention:  jetstream.LimitsPolicy,
		Discard:    jetstream.DiscardOld,
		MaxAge:     cfg.MaxAge,
		MaxBytes:   cfg.MaxBytes,
		MaxMsgs:    -1,
		Storage:    jetstream.FileStorage,
		Replicas:   cfg.Replicas,
		Duplicates: cfg.DuplicateWindow,
		// Events leave only by age: no API call may delete or purge them
		// (JetStream never lets these flags be turned off again). A new
		// subscriber replays this history, and a purge would drop events
		// no subscriber has handled yet.
		DenyDelete: true,
		DenyPurge:  true,
		Metadata: map[string]string{
			"fanout.owner":        "fanout provision, or the relay with stream.provision=auto",
			"fanout.source":       "postgres table outbox",
			"fanout.msg_id":       "outbox.id",
			"fanout.subject_form": cfg.SubjectPrefix + ".<event_type>",
		},
	}
}

// ErrUnfit is wrapped by the errors Ensure returns for a stream
// that exists but cannot carry fanout's events safely.
var ErrUnfit = errors.New("stream unfit for fanout")

// Ensure creates or updates the stream (provision auto), checks it
// (verify), or does nothing (off). In auto and verify it refuses a stream
// whose duplicates window is not longer than minDuplicates (the longest a
// row's second publish can follow its first, relay.RepublishDelay): the
// stream would then store that row twice.
func Ensure(ctx context.Context, js jetstream.JetStream, cfg Config, minDuplicates time.Duration, logger *slog.Logger) error {
	want := JetStreamConfig(cfg)
	var info *jetstream.StreamInfo
	switch cfg.Provision {
	case "off":
		logger.Info("stream provisioning off: not checking the stream", "stream", cfg.Name)
		return nil
	case "auto":
		s, err := js.CreateOrUpdateStream(ctx, want)
		if err != nil {
			return fmt.Errorf("provision stream %s (stream.provision=auto): %w", cfg.Name, err)
		}
		info = s.CachedInfo()
		logger.Info("stream provisioned", "stream", cfg.Name, "messages", info.State.Msgs, "replicas", info.Config.Replicas)
	case "verify":
		s, err := js.Stream(ctx, cfg.Name)
		if err != nil {
			return fmt.Errorf("verify stream %s (stream.provision=verify): %w", cfg.Name, err)
		}
		info = s.CachedInfo()
	default:
		return fmt.Errorf("stream.provision must be auto, verify or off (got %q)", cfg.Provision)
	}
	return check(info, cfg, minDuplicates, logger)
}

func check(info *jetstream.StreamInfo, cfg Config, minDuplicates time.Duration, logger *slog.Logger) error {
	c := info.Config
	var errs []error
	if need := minDuplicates; c.Duplicates <= need {
		errs = append(errs, fmt.Errorf("%w: stream %s has a duplicates window of %s, which must be longer than relay.lease + relay.publish_timeout + relay.reap_interval + relay.retry_max = %s",
			ErrUnfit, c.Name, c.Duplicates, need))
	}
	wantSubject := cfg.SubjectPrefix + ".>"
	if !slices.Contains(c.Subjects, wantSubject) && !slices.Contains(c.Subjects, ">") {
		errs = append(errs, fmt.Errorf("%w: stream %s listens on %v, not on %s", ErrUnfit, c.Name, c.Subjects, wantSubject))
	}
	if c.Retention == jetstream.WorkQueuePolicy {
		errs = append(errs, fmt.Errorf("%w: stream %s has work-queue retention, which allows one subscriber per event; fanout needs limits retention", ErrUnfit, c.Name))
	}
	if c.Retention == jetstream.InterestPolicy {
		logger.Warn("stream has interest retention: a new subscriber cannot replay history", "stream", c.Name)
	}
	if !c.DenyDelete || !c.DenyPurge {
		logger.Warn("stream allows deleting or purging messages: events no subscriber handled yet can be removed by an API call (`fanout provision` sets deny_delete and deny_purge)", "stream", c.Name)
	}
	if c.Storage != jetstream.FileStorage {
		logger.Warn("stream uses memory storage: a broker restart loses every event", "stream", c.Name)
	}
	return errors.Join(errs...)
}
