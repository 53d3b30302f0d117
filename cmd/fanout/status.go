package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/fanout/fanout/operator"
	"github.com/spf13/cobra"
)

func statusCommand(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Outbox backlog, stream size, and each subscriber's lag, checkpoint and dead letters",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.load(); err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			pool, err := a.postgres(ctx, "status")
			if err != nil {
				return err
			}
			defer pool.Close()
			nc, js, err := a.jetStream("status")
			if err != nil {
				return err
			}
			defer nc.Close()
			st, err := operator.ReadStatus(ctx, operator.Sources{Pool: pool, JS: js, Stream: a.cfg.Stream,
				Subscribers: a.cfg.Subscribers, Known: subscriberNames()})
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(st)
			}
			printStatus(cmd.OutOrStdout(), st)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON for scripts")
	return cmd
}

func printStatus(w io.Writer, st operator.Status) {
	o := st.Outbox
	fmt.Fprintf(w, "outbox   pending %d  sending %d  sent %d (retained)  failed %d  oldest pending %s\n",
		o.Pending, o.Sending, o.Sent, o.Failed, (time.Duration(o.OldestPendingAge * float64(time.Second))).Round(time.Millisecond))
	if st.Stream.Missing {
		fmt.Fprintf(w, "stream   %s  not created yet (the relay creates it at start unless stream.provision is verify or off)\n\n", st.Stream.Name)
	} else {
		fmt.Fprintf(w, "stream   %s  %d messages  %d bytes  seq %d..%d\n\n", st.Stream.Name, st.Stream.Messages, st.Stream.Bytes, st.Stream.FirstSeq, st.Stream.LastSeq)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SUBSCRIBER\tPENDING\tACK PENDING\tREDELIVERED\tCHECKPOINT\tDEAD LETTERS")
	for _, s := range st.Subscribers {
		pending := fmt.Sprint(s.Pending)
		if s.ConsumerGone {
			pending = "(no consumer)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\n", s.Name, pending, s.AckPending, s.Redelivered, s.Checkpoint, s.DeadLetters)
	}
	tw.Flush()
}
