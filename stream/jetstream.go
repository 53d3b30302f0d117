package stream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// JetStreamConfig is the stream that stream.provision=auto creates.
func JetStreamConfig(cfg Config) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name: cfg.Name,
		Description: "fanout: domain events relayed from the Postgres outbox. " +
			"Nats-Msg-Id is <origin>:<outbox row id>; subjects are " + cfg.SubjectPrefix + ".<event_type>.",
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
		// Reads by sequence, in batches (the relay's audit and its
		// restore check): served by any replica, and without the
		// stream's API queue.
		AllowDirect: true,
		// An aggregate's events waiting behind one another go in one
		// batch the stream stores whole and in order (package relay,
		// atomic.go), not a round trip each.
		AllowAtomicPublish: true,
		Metadata:           metadata(cfg),
	}
}

func metadata(cfg Config) map[string]string {
	md := map[string]string{
		"fanout.provisioned_by": "fanout provision, or the relay with stream.provision=auto",
		"fanout.source":         "postgres table outbox",
		"fanout.msg_id":         "<Fanout-Origin>:<outbox.id>",
		"fanout.subject_form":   cfg.SubjectPrefix + ".<event_type>",
	}
	if owner := cfg.Owner(""); owner != "" {
		md[OwnerKey] = owner
	}
	return md
}

// ErrUnfit is wrapped by the errors Ensure returns for a stream
// that exists but cannot carry fanout's events safely.
var ErrUnfit = errors.New("stream unfit for fanout")

// Ensure creates the stream or brings it to its configuration, never
// lowering a limit (provision auto), checks it (verify), or does nothing
// (off). In auto and verify it refuses a stream whose duplicates window is
// not longer than minDuplicates (the longest a row's second publish can
// follow its first, relay.RepublishDelay): the stream would then store that
// row twice.
func Ensure(ctx context.Context, js jetstream.JetStream, cfg Config, minDuplicates time.Duration, logger *slog.Logger) error {
	var info *jetstream.StreamInfo
	switch cfg.Provision {
	case "off":
		logger.Info("stream provisioning off: not checking the stream", "stream", cfg.Name)
		return nil
	case "auto":
		var err error
		info, err = Provision(ctx, js, JetStreamConfig(cfg), Changes{Update: true}, logger)
		if err != nil {
			return fmt.Errorf("provision stream %s (stream.provision=auto): %w", cfg.Name, err)
		}
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
	return Check(info, cfg, minDuplicates, logger)
}

// Changes says what Provision may do to a stream that exists.
type Changes struct {
	// Update lets it bring the stream to its configuration.
	Update bool
	// AllowLower lets that update lower a limit, which drops the stored
	// messages beyond the new one.
	AllowLower bool
	// ReplaceOwner lets that update record another owning database (see
	// OwnerKey) than the stream records. Without it, an owner is only
	// recorded where none is: a relay never takes another database's
	// stream.
	ReplaceOwner bool
}

// ErrDiffers is wrapped by Provision's error for an existing stream it was
// not allowed to change.
var ErrDiffers = errors.New("stream differs from fanout's configuration")

// Provision creates the stream want if it does not exist. An existing one
// whose settings differ is updated only as changes allows: the identity
// `fanout provision` runs as may create streams but not change them (an
// update can lower a limit, which drops events as a purge would).
func Provision(ctx context.Context, js jetstream.JetStream, want jetstream.StreamConfig, changes Changes, logger *slog.Logger) (*jetstream.StreamInfo, error) {
	s, err := js.Stream(ctx, want.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		s, err = js.CreateStream(ctx, want)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Created a moment ago by another role starting.
			s, err = js.Stream(ctx, want.Name)
		} else if errors.Is(err, nats.ErrNoResponders) {
			return nil, refused("create", want.Name, err)
		}
	}
	if err != nil {
		return nil, err
	}
	info := s.CachedInfo()
	diffs := append(StreamDifferences(info.Config, want), AdvisoryDifferences(info.Config, want)...)
	// An owner is filled in where none is recorded, replaced only when
	// told, and listed by a provision that may change nothing: a relay
	// never takes another database's stream.
	if d, ok := OwnerDifference(info.Config, want); ok && (d.Have == "" || changes.ReplaceOwner || !changes.Update) {
		diffs = append(diffs, d)
	}
	if len(diffs) == 0 {
		return info, nil
	}
	if !changes.Update {
		return info, fmt.Errorf("%w: stream %s: %s. `fanout provision` creates streams but does not change one that exists: its administrator does, with `fanout provision --update-stream %s` (or `nats stream edit %s`)",
			ErrDiffers, want.Name, Join(diffs), want.Name, want.Name)
	}
	var lower []Difference
	for _, d := range diffs {
		if d.Lowers {
			lower = append(lower, d)
		}
	}
	if len(lower) > 0 && !changes.AllowLower {
		return info, fmt.Errorf("%w: stream %s: %s. A lower limit drops the events beyond it at once: `fanout provision --update-stream %s --allow-lower` applies it",
			ErrDiffers, want.Name, Join(lower), want.Name)
	}
	for _, d := range diffs {
		logger.Warn("changing a setting of a live stream", "stream", want.Name, "field", d.Field, "from", d.Have, "to", d.Want, "lowers_a_limit", d.Lowers)
	}
	s, err = js.UpdateStream(ctx, want)
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) || errors.Is(err, nats.ErrNoResponders) {
		return nil, refused("update", want.Name, err)
	}
	if err != nil {
		return nil, fmt.Errorf("update stream %s (%s): %w", want.Name, Join(diffs), err)
	}
	return s.CachedInfo(), nil
}

// refused is the error of a stream call that got no answer after the
// stream's lookup did: the identity may not make it (a permission refused
// gets no answer; an API call its account does not import, no responder).
// Not %w: a caller retrying timeouts and missing responders, as a role
// starting with its broker does, would wait forever.
func refused(op, name string, err error) error {
	return fmt.Errorf("%s stream %s: no answer (%v): this identity may not %s streams (with deploy/nats/nats-server.conf the provisioner creates them and each stream's administrator changes it)", op, name, err, op)
}

// Check refuses a stream that cannot carry fanout's events safely (see
// Ensure), and warns of one that can but loses them more easily.
func Check(info *jetstream.StreamInfo, cfg Config, minDuplicates time.Duration, logger *slog.Logger) error {
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
