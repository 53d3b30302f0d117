package main

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

func provisionCommand(a *app) *cobra.Command {
	var updates []string
	var allowLower, check bool
	cmd := &cobra.Command{
		Use:   "provision [subscriber]...",
		Short: "Create the JetStream streams and every consumer, as the one identity allowed to (a one-shot job)",
		Long: `provision creates stream EVENTS (the relay's) and stream DEADLETTER if they do
not exist, and creates or brings to its configuration the durable consumer of
every subscriber (or of the ones named), and the pull consumers the relay's
audits and the operator's reindex read the stream through (relay_audit,
relay_audit_command, operator_reindex_searchindex: one fixed configuration
each; their users only move them and pull, and refuse one that differs). Run it as the provisioning identity,
before the roles, and after adding a subscriber: with stream.provision and
subscribers.dead_letter_provision set to verify, the relay and the
subscribers then need no right to create or change any of them (see
deploy/nats/nats-server.conf). Both streams deny deleting and purging
messages. A consumer that exists keeps its position.

A stream that exists is not changed: its differences from the configuration
are listed and provision fails. --update-stream NAME applies them to that
stream and does nothing else, as an identity allowed to update it (the
shipped provisioner is not: an update that lowers a limit drops events as a
purge would; in deploy/nats/nats-server.conf each stream's administrator
is: admin for EVENTS, admin_deadletter for DEADLETTER); a lower limit also
needs --allow-lower. --check changes nothing and lists every difference of
the streams and consumers from the configuration.`,
		RunE: a.loaded(func(cmd *cobra.Command, args []string) error {
			if allowLower && len(updates) == 0 {
				return errors.New("--allow-lower goes with --update-stream")
			}
			if check && len(updates) > 0 {
				return errors.New("--check changes nothing: give it without --update-stream")
			}
			decls, err := declarationsToProvision(args)
			if err != nil {
				return err
			}
			nc, js, err := a.jetStream("provision")
			if err != nil {
				return err
			}
			defer nc.Close()
			logger := logging.Component(a.logger, "provision")
			if check {
				return provisionCheck(cmd, a, js, decls)
			}
			if len(updates) > 0 {
				return provisionUpdate(cmd, a, js, updates, allowLower, logger)
			}
			return provisionAll(cmd, a, js, decls, logger)
		}),
	}
	cmd.Flags().StringSliceVar(&updates, "update-stream", nil, "bring this existing stream to the configuration, and do nothing else (as an identity allowed to update it; repeatable)")
	cmd.Flags().BoolVar(&allowLower, "allow-lower", false, "with --update-stream, also lower a stream's limits (drops the events beyond the new limit)")
	cmd.Flags().BoolVar(&check, "check", false, "change nothing; list every difference of the streams and consumers from the configuration, and fail if there is one")
	return cmd
}

// declarationsToProvision are the subscribers named, or every one this
// binary knows.
func declarationsToProvision(names []string) ([]subscribers.Declaration, error) {
	if len(names) == 0 {
		names = subscriberNames()
	}
	var decls []subscribers.Declaration
	for _, name := range names {
		d, err := subscriberRegistry.Lookup(name)
		if err != nil {
			return nil, err
		}
		decls = append(decls, d)
	}
	return decls, nil
}

// provisionAll creates the two streams where they do not exist (and fails
// on one that differs from the configuration), then creates or updates the
// consumers of decls.
func provisionAll(cmd *cobra.Command, a *app, js jetstream.JetStream, decls []subscribers.Declaration, logger *slog.Logger) error {
	ctx := cmd.Context()
	changes := stream.Changes{}
	out := cmd.OutOrStdout()

	events := a.cfg.Stream
	var info *jetstream.StreamInfo
	if err := jsretry.Do(ctx, logger, "provision the events stream", func() error {
		var err error
		info, err = stream.Provision(ctx, js, stream.JetStreamConfig(events), changes, logger)
		return err
	}); err != nil {
		return err
	}
	if err := stream.Check(info, events, relay.RepublishDelay(a.cfg.Relay), logger); err != nil {
		return err
	}
	fmt.Fprintf(out, "stream %s: subjects %s.>, max age %s, duplicates window %s, %d replicas, deletes and purges denied\n",
		events.Name, events.SubjectPrefix, events.MaxAge, events.DuplicateWindow, events.Replicas)

	var dl *jetstream.StreamInfo
	if err := jsretry.Do(ctx, logger, "provision the dead-letter stream", func() error {
		var err error
		dl, err = subscribers.ProvisionDeadLetterStream(ctx, js, a.cfg.Subscribers, events.Replicas, changes, logger)
		return err
	}); err != nil {
		return err
	}
	fmt.Fprintf(out, "stream %s: subjects %s, max age %s, deletes and purges denied\n",
		dl.Config.Name, strings.Join(dl.Config.Subjects, ", "), dl.Config.MaxAge)
	return provisionConsumers(cmd, a, js, decls, logger)
}

// provisionConsumers creates the consumer of each of decls, or brings it
// to its configuration (keeping its position).
func provisionConsumers(cmd *cobra.Command, a *app, js jetstream.JetStream, decls []subscribers.Declaration, logger *slog.Logger) error {
	ctx := cmd.Context()
	events, err := js.Stream(ctx, a.cfg.Stream.Name)
	if err != nil {
		return err
	}
	for _, d := range decls {
		name := d.Name
		var c jetstream.Consumer
		if err := jsretry.Do(ctx, logger, "provision consumer "+name, func() error {
			var err error
			c, err = subscribers.ProvisionConsumer(ctx, events, d, a.cfg.Subscriber(d.Name), a.cfg.Stream)
			return err
		}); err != nil {
			return fmt.Errorf("subscriber %s: %w", name, err)
		}
		info := c.CachedInfo()
		fmt.Fprintf(cmd.OutOrStdout(), "consumer %s: filters %s, %d pending\n", name, strings.Join(info.Config.FilterSubjects, ", "), info.NumPending)
	}
	for _, want := range readerConsumerConfigs(a) {
		if err := jsretry.Do(ctx, logger, "provision consumer "+want.Durable, func() error {
			_, err := stream.EnsureReader(ctx, events, want, true)
			return err
		}); err != nil {
			return err
		}
		fmt.Fprintf(cmd.OutOrStdout(), "consumer %s: a pull consumer without acks, its reader moves it\n", want.Durable)
	}
	return nil
}

// readerConsumerConfigs are the consumers the roles other than the
// subscribers read the events stream through: the relay's audits and the
// operator's reindex. Only the provisioner makes them (with
// stream.provision verify or off); their users move them and pull.
func readerConsumerConfigs(a *app) []jetstream.ConsumerConfig {
	return []jetstream.ConsumerConfig{
		stream.AuditConsumerConfig(stream.AuditConsumer),
		stream.AuditConsumerConfig(stream.AuditCommandConsumer),
		searchindex.ReplayConsumerConfig(a.cfg.Stream),
	}
}

// provisionUpdate brings each named stream, which must exist where this
// identity sees it, to the configuration. It creates nothing: an
// administrator of one stream's account who ran it for both would create a
// second dead-letter stream in the events' account.
func provisionUpdate(cmd *cobra.Command, a *app, js jetstream.JetStream, names []string, allowLower bool, logger *slog.Logger) error {
	ctx := cmd.Context()
	wants := streamConfigs(a)
	for _, name := range names {
		i := slices.IndexFunc(wants, func(c jetstream.StreamConfig) bool { return c.Name == name })
		if i < 0 {
			return fmt.Errorf("--update-stream %s: fanout has streams %s and %s only", name, a.cfg.Stream.Name, a.cfg.Subscribers.DeadLetterStream)
		}
		if _, err := js.Stream(ctx, name); errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("--update-stream %s: this identity sees no stream %s (with deploy/nats/nats-server.conf, run it as the administrator of that stream's account), and --update-stream creates none", name, name)
		} else if err != nil {
			return err
		}
		info, err := stream.Provision(ctx, js, wants[i], stream.Changes{Update: true, AllowLower: allowLower, ReplaceOwner: true}, logger)
		if err != nil {
			return err
		}
		fmt.Fprintf(cmd.OutOrStdout(), "stream %s: as configured (max age %s, %d replicas)\n", name, info.Config.MaxAge, info.Config.Replicas)
	}
	return nil
}

// streamConfigs are the two streams as the configuration makes them: the
// events stream and the dead letters'.
func streamConfigs(a *app) []jetstream.StreamConfig {
	return []jetstream.StreamConfig{stream.JetStreamConfig(a.cfg.Stream), subscribers.DeadLetterStreamConfig(a.cfg.Subscribers, a.cfg.Stream.Replicas)}
}

// provisionCheck lists every setting of the streams and of the consumers of
// decls that is not what the configuration makes it, and fails if there is
// one (or one of them does not exist).
func provisionCheck(cmd *cobra.Command, a *app, js jetstream.JetStream, decls []subscribers.Declaration) error {
	ctx := cmd.Context()
	out := cmd.OutOrStdout()
	found := 0
	report := func(what string, ds []stream.Difference, err error) {
		switch {
		case err != nil:
			fmt.Fprintf(out, "%s: %v\n", what, err)
			found++
		case len(ds) == 0:
			fmt.Fprintf(out, "%s: as configured\n", what)
		}
		for _, d := range ds {
			fmt.Fprintf(out, "%s: %s\n", what, d)
		}
		found += len(ds)
	}
	for _, want := range streamConfigs(a) {
		var ds []stream.Difference
		s, err := js.Stream(ctx, want.Name)
		if err == nil {
			have := s.CachedInfo().Config
			ds = append(stream.StreamDifferences(have, want), stream.AdvisoryDifferences(have, want)...)
			if d, ok := stream.OwnerDifference(have, want); ok {
				ds = append(ds, d)
			}
		}
		report("stream "+want.Name, ds, err)
	}
	for _, d := range decls {
		var ds []stream.Difference
		c, err := js.Consumer(ctx, a.cfg.Stream.Name, d.Name)
		if err == nil {
			want := subscribers.ConsumerConfig(d.Name, d.EventTypes, d.Ordered, a.cfg.Subscriber(d.Name), a.cfg.Stream)
			ds = stream.ConsumerDifferences(c.CachedInfo().Config, want)
		}
		report("consumer "+d.Name, ds, err)
	}
	for _, want := range readerConsumerConfigs(a) {
		var ds []stream.Difference
		have, err := stream.ConsumerConfigOf(ctx, js, a.cfg.Stream.Name, want.Durable)
		if err == nil {
			ds = stream.ReaderDifferences(have, want)
		}
		report("consumer "+want.Durable, ds, err)
	}
	if found > 0 {
		return fmt.Errorf("%d differences from the configuration", found)
	}
	return nil
}
