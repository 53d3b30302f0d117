package main

import (
	"fmt"
	"io"
	"time"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/relay"
	"github.com/spf13/cobra"
)

func auditCommand(a *app) *cobra.Command {
	var since string
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "audit [--since TIME] [--dry-run]",
		Short: "Check that every event the outbox still holds is in the stream, and publish again what is not",
		Long: `audit checks the stream against the outbox, as the relays' auditor does:
every published row the outbox still holds (relay.sent_retention after its
publish) must be in the stream at the sequence its PubAck gave, with its
identity (Nats-Msg-Id). A missing event is published again from its row,
with the same identity; the subscribers' checkpoints absorb it where they
had seen it. Each repair is logged with the row and the sequence, and the
audit is recorded (fanout status shows it).

With --since (RFC 3339, or a duration such as 30m meaning that long ago)
only the events published since then are checked: faster after a broker
lost its last writes. --dry-run only reports.

It runs as the relay (its Postgres role and NATS user): it reads the stream
by sequence and publishes events.`,
		Args: cobra.NoArgs,
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
			var from time.Time
			if since != "" {
				t, err := parseSince(since)
				if err != nil {
					return err
				}
				from = t
			}
			c, err := a.open(cmd.Context(), "relay", withNATS, relaySessions()...)
			if err != nil {
				return err
			}
			defer c.close()
			out := cmd.OutOrStdout()
			start := time.Now()
			rep, err := relay.Audit(cmd.Context(), relay.Options{
				Relay: a.cfg.Relay, Stream: a.cfg.Stream, Pool: c.pool, Conn: c.nc, Logger: logging.Component(a.logger, "audit"),
			}, from, dryRun, auditProgress(out, start))
			if err != nil {
				return err
			}
			printAudit(out, rep, time.Since(start), a.cfg.Stream.Name, dryRun)
			if len(rep.Lost) > 0 {
				return fmt.Errorf("events missing from the stream whose outbox rows are gone too: %v", rep.Lost)
			}
			if dryRun && rep.Missing > 0 {
				return fmt.Errorf("%d events missing from the stream", rep.Missing)
			}
			if rep.Altered > 0 {
				return fmt.Errorf("%d events in the stream with other content than their outbox rows: %v", rep.Altered, rep.AlteredIDs)
			}
			return nil
		}),
	}
	cmd.Flags().StringVar(&since, "since", "", "check only the events published since TIME (RFC 3339, or a duration ago: 30m)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "report, publish nothing")
	return cmd
}

// auditProgress prints an audit's progress at most once a second, and its
// last step's end.
func auditProgress(out io.Writer, start time.Time) func(what string, done, of int64, rep relay.AuditReport) {
	last := time.Time{}
	return func(what string, done, of int64, rep relay.AuditReport) {
		if time.Since(last) < time.Second && done < of {
			return
		}
		last = time.Now()
		fmt.Fprintf(out, "[%5.0fs] %s: %d of %d ids  checked %d  missing %d  repaired %d\n",
			time.Since(start).Seconds(), what, done, of, rep.Checked, rep.Missing, rep.Repaired)
	}
}

// printAudit prints the line that sums up an audit of stream streamName
// that ran for elapsed.
func printAudit(out io.Writer, rep relay.AuditReport, elapsed time.Duration, streamName string, dryRun bool) {
	verb := "published again"
	if dryRun {
		verb = "would be published again (--dry-run)"
	}
	fmt.Fprintf(out, "audited %d events in %s: %d missing from stream %s, %d %s",
		rep.Checked, elapsed.Round(time.Millisecond), rep.Missing, streamName, rep.Repaired, verb)
	if rep.Unrecorded > 0 {
		fmt.Fprintf(out, "; %d of them published with no landing recorded", rep.Unrecorded)
	}
	if rep.AgedOut > 0 {
		fmt.Fprintf(out, "; %d below the stream's first sequence (removed by its limits)", rep.AgedOut)
	}
	if rep.AgedUnconsumed > 0 {
		fmt.Fprintf(out, "; %d of them removed by the stream's limits before a consumer acknowledged them", rep.AgedUnconsumed)
	}
	if rep.Altered > 0 {
		fmt.Fprintf(out, "; %d altered: in the stream with other content than their outbox rows (events %v)", rep.Altered, rep.AlteredIDs)
	}
	fmt.Fprintln(out)
}
