package main

import (
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
	return &cobra.Command{
		Use:   "provision [subscriber]...",
		Short: "Create or update the JetStream streams and the subscribers' consumers, as the one identity allowed to (a one-shot job)",
		Long: `provision creates or brings to their configuration stream EVENTS (the relay's),
stream DEADLETTER, and the durable consumer of every subscriber (or of the
ones named). Run it as the provisioning identity, before the roles, and after
adding a subscriber or changing a stream setting: with stream.provision and
subscribers.dead_letter_provision set to verify, the relay and the
subscribers then need no right to create or change any of them (see
deploy/nats/nats-server.conf). Both streams deny deleting and purging
messages. A consumer that exists keeps its position.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.load(); err != nil {
				return err
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
			out := cmd.OutOrStdout()

			events := a.cfg.Stream
			events.Provision = "auto"
			if err := jsretry.Do(ctx, logger, "provision the events stream", func() error {
				return stream.Ensure(ctx, js, events, relay.RepublishDelay(a.cfg.Relay), logger)
			}); err != nil {
				return err
			}
			fmt.Fprintf(out, "stream %s: subjects %s.>, max age %s, duplicates window %s, %d replicas, deletes and purges denied\n",
				events.Name, events.SubjectPrefix, events.MaxAge, events.DuplicateWindow, events.Replicas)

			var dl *jetstream.StreamInfo
			if err := jsretry.Do(ctx, logger, "provision the dead-letter stream", func() error {
				var err error
				dl, err = subscribers.ProvisionDeadLetterStream(ctx, js, a.cfg.Subscribers, events.Replicas)
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
}
