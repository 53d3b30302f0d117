package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

func replayCommand(a *app) *cobra.Command {
	var fromTime string
	var fromSeq uint64
	cmd := &cobra.Command{
		Use:   "replay <subscriber> --from-time T | --from-seq N",
		Short: "Move one subscriber's consumer back, so it receives the stream's history again from T or N",
		Long: `replay resets one subscriber's durable consumer to a stream position; its
running instances receive the events from there on again. Other subscribers
are not touched. The subscriber's checkpoint makes this safe: events it already
handled are acked and skipped, so a replay fills gaps (events lost or skipped)
without doing anything twice. The consumer must have been created with
subscribers.start = all or time (the default is all).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.load(); err != nil {
				return err
			}
			if (fromTime == "") == (fromSeq == 0) {
				return errors.New("give exactly one of --from-time and --from-seq")
			}
			ctx := cmd.Context()
			nc, js, err := a.jetStream("replay")
			if err != nil {
				return err
			}
			defer nc.Close()
			name := args[0]
			if _, err := js.Consumer(ctx, a.cfg.Stream.Name, name); err != nil {
				return fmt.Errorf("subscriber %s: %w", name, err)
			}
			seq := fromSeq
			if fromTime != "" {
				t, err := parseSince(fromTime)
				if err != nil {
					return err
				}
				// The first message at or after t: an ordered consumer
				// starting by time tells its stream sequence.
				oc, err := js.OrderedConsumer(ctx, a.cfg.Stream.Name, jetstream.OrderedConsumerConfig{
					DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &t})
				if err != nil {
					return err
				}
				m, err := oc.Next(jetstream.FetchMaxWait(2 * time.Second))
				if err != nil {
					return fmt.Errorf("no event in stream %s at or after %s: %w", a.cfg.Stream.Name, t.UTC().Format(time.RFC3339), err)
				}
				md, err := m.Metadata()
				if err != nil {
					return err
				}
				seq = md.Sequence.Stream
			}
			_, err = js.ResetConsumerToSequence(ctx, a.cfg.Stream.Name, name, seq)
			if errors.Is(err, jetstream.ErrConsumerInvalidReset) {
				return fmt.Errorf("subscriber %s: its consumer's start position does not allow sequence %d (was it created with subscribers.start=new?): %w", name, seq, err)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "subscriber %s will receive stream %s again from sequence %d; its checkpoint skips what it already handled\n", name, a.cfg.Stream.Name, seq)
			return nil
		},
	}
	cmd.Flags().StringVar(&fromTime, "from-time", "", "RFC 3339 time, or a duration ago (e.g. 2h)")
	cmd.Flags().Uint64Var(&fromSeq, "from-seq", 0, "stream sequence number")
	return cmd
}
