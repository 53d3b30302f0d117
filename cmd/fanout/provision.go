package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/fanout/fanout/internal/jsretry"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

func provisionCommand(a *app) *cobra.Command {
	var changes stream.Changes
	var check bool
	cmd := &cobra.Command{
		Use:   "provision [subscriber]...",
		Short: "Create the JetStream streams and the subscribers' consumers, as the one identity allowed to (a one-shot job)",
		Long: `provision creates stream EVENTS (the relay's) and stream DEADLETTER if they do
not exist, and creates or brings to its configuration the durable consumer of
every subscriber (or of the ones named). Run it as the provisioning identity,
before the roles, and after adding a subscriber: with stream.provision and
subscribers.dead_letter_provision set to verify, the relay and the
subscribers then need no right to create or change any of them (see
deploy/nats/nats-server.conf). Both streams deny deleting and purging
messages. A consumer that exists keeps its position.

A stream that exists is not changed: its differences from the configuration
are listed and provision fails. --update-streams applies them, as an identity
allowed to update streams (the shipped provisioner is not: an update that
lowers a limit drops events as a purge would); a lower limit also needs
--allow-lower. --check changes nothing and lists every difference of the
streams and consumers from the configuration.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.load(); err != nil {
				return err
			}
			if changes.AllowLower && !changes.Update {
				return errors.New("--allow-lower goes with --update-streams")
			}
			if check && changes.Update {
				return errors.New("--check changes nothing: give it without --update-streams")
			}
			names := args
			if len(names) == 0 {
				names = subscriberNames()
			}
			var decls []subscribers.Declaration
			for _, name := range names {
				d, err := subscriberRegistry.Lookup(name)
				if err != nil {
					return err
				}
				decls = append(decls, d)
			}
			ctx := cmd.Context()
			nc, js, err := a.jetStream("provision")
			if err != nil {
				return err
			}
			defer nc.Close()
			logger := logging.Component(a.logger, "provision")
			if check {
				return provisionCheck(cmd, a, js, decls)
			}
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

			stream, err := js.Stream(ctx, events.Name)
			if err != nil {
				return err
			}
			for _, d := range decls {
				name := d.Name
				var c jetstream.Consumer
				if err := jsretry.Do(ctx, logger, "provision consumer "+name, func() error {
					var err error
					c, err = subscribers.ProvisionConsumer(ctx, stream, d, a.cfg.Subscriber(d.Name), a.cfg.Stream)
					return err
				}); err != nil {
					return fmt.Errorf("subscriber %s: %w", name, err)
				}
				info := c.CachedInfo()
				fmt.Fprintf(out, "consumer %s: filters %s, %d pending\n", name, strings.Join(info.Config.FilterSubjects, ", "), info.NumPending)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&changes.Update, "update-streams", false, "bring existing streams to the configuration (needs an identity allowed to update streams)")
	cmd.Flags().BoolVar(&changes.AllowLower, "allow-lower", false, "with --update-streams, also lower a stream's limits (drops the events beyond the new limit)")
	cmd.Flags().BoolVar(&check, "check", false, "change nothing; list every difference of the streams and consumers from the configuration, and fail if there is one")
	return cmd
}

// provisionCheck lists every setting of the streams and of the consumers of
// decls that is not what the configuration makes it, and fails if there is
// one (or one of them does not exist).
func provisionCheck(cmd *cobra.Command, a *app, js jetstream.JetStream, decls []subscribers.Declaration) error {
	ctx := cmd.Context()
	out := cmd.OutOrStdout()
	found := 0
	report := func(what string, have func() (any, error), diffs func(any) []stream.Difference) {
		v, err := have()
		if err != nil {
			fmt.Fprintf(out, "%s: %v\n", what, err)
			found++
			return
		}
		ds := diffs(v)
		if len(ds) == 0 {
			fmt.Fprintf(out, "%s: as configured\n", what)
			return
		}
		for _, d := range ds {
			fmt.Fprintf(out, "%s: %s\n", what, d)
		}
		found += len(ds)
	}
	for _, want := range []jetstream.StreamConfig{stream.JetStreamConfig(a.cfg.Stream), subscribers.DeadLetterStreamConfig(a.cfg.Subscribers, a.cfg.Stream.Replicas)} {
		report("stream "+want.Name, func() (any, error) {
			s, err := js.Stream(ctx, want.Name)
			if err != nil {
				return nil, err
			}
			return s.CachedInfo().Config, nil
		}, func(v any) []stream.Difference { return stream.StreamDifferences(v.(jetstream.StreamConfig), want) })
	}
	for _, d := range decls {
		want := subscribers.ConsumerConfig(d.Name, d.EventTypes, d.Ordered, a.cfg.Subscriber(d.Name), a.cfg.Stream)
		report("consumer "+d.Name, func() (any, error) {
			c, err := js.Consumer(ctx, a.cfg.Stream.Name, d.Name)
			if err != nil {
				return nil, err
			}
			return c.CachedInfo().Config, nil
		}, func(v any) []stream.Difference {
			return subscribers.ConsumerDifferences(v.(jetstream.ConsumerConfig), want)
		})
	}
	if found > 0 {
		return fmt.Errorf("%d differences from the configuration", found)
	}
	return nil
}
