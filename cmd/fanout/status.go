package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/operator"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/spf13/cobra"
)

func statusCommand(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Outbox backlog, stream size, each subscriber's lag, checkpoint and dead letters, and the last minute's latency of each stage",
		Long: `Outbox backlog, stream size, each subscriber's lag, checkpoint and dead
letters, read from Postgres and JetStream; and the latency of each stage of
an event's way over the last minute (commit → PubAck, PubAck → delivered,
delivered → handled, and for the search indexer handled → searchable), read
from the running roles' operations endpoints: http.peers (host:port,
comma-separated; FANOUT_HTTP_PEERS), or http.addr, where ` + "`fanout up`" + ` serves
them all.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			c, err := a.open(ctx, "status", withNATS)
			if err != nil {
				return err
			}
			defer c.close()
			st, err := operator.ReadStatus(ctx, operator.Sources{Pool: c.pool, JS: c.js, Relay: a.cfg.Relay, Stream: a.cfg.Stream,
				Subscribers: a.cfg.Subscribers, Known: subscriberNames(), Ops: a.cfg.HTTP.PeerList()})
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
	printOutbox(w, st)
	printAudits(w, st.Audits)
	printStream(w, st)
	printSubscribers(w, st.Subscribers)
	for _, b := range st.Backfills {
		printBackfill(w, b)
	}
	for _, r := range st.Replays {
		printReplay(w, r)
	}
	if st.Stages != nil {
		printStages(w, *st.Stages)
	}
}

// printOutbox prints the database's identity, the outbox's rows (and in
// wal capture the slot), what is held behind failed rows, the unnumbered
// types and the ranges.
func printOutbox(w io.Writer, st operator.Status) {
	fmt.Fprintf(w, "database %s  outbox epoch %d", st.Database.Name, st.Database.Epoch)
	if n := len(st.Database.Epochs); n > 1 {
		fmt.Fprintf(w, " (from id %d: a restore rewound the ids; see outbox_epochs)", st.Database.Epochs[n-1].FirstID)
	}
	fmt.Fprintln(w)
	o := st.Outbox
	if c := st.Capture; c.Mode == relay.CaptureWAL {
		// The wal relay marks nothing: its captured rows stay pending.
		fmt.Fprintf(w, "outbox   %d rows retained (captured rows stay pending)  sent %d  failed %d\n", o.Pending+o.Sending, o.Sent, o.Failed)
		printSlot(w, c)
	} else {
		fmt.Fprintf(w, "outbox   pending %d  sending %d  sent %d (retained)  failed %d  oldest pending %s\n",
			o.Pending, o.Sending, o.Sent, o.Failed, (time.Duration(o.OldestPendingAge * float64(time.Second))).Round(time.Millisecond))
	}
	if o.HeldRows > 0 {
		fmt.Fprintf(w, "held     %d events of %d aggregates wait behind a failed earlier event (relay.on_failed hold): fanout outbox retry-failed or fanout outbox skip ID releases them\n",
			o.HeldRows, o.HeldAggregates)
	}
	if len(o.Unnumbered) > 0 {
		fmt.Fprintf(w, "numbers  every event is numbered in its aggregate except those of type %s (fanout outbox numbering)\n", strings.Join(o.Unnumbered, ", "))
	}
	fmt.Fprintf(w, "ranges   %d (%d full, waiting for relay.sent_retention and an audit)  outbox_default %d rows (no range holds them)\n",
		o.Ranges, o.SealedRanges, o.DefaultRows)
}

// printSlot prints the wal relays' replication slot.
func printSlot(w io.Writer, c operator.CaptureStatus) {
	if c.Slot == nil {
		fmt.Fprintf(w, "capture  wal  slot not created yet (the relay creates it at start)\n")
		return
	}
	active, backlog := "standing by (no relay streams from it)", "rows from before the slot: published"
	if c.Slot.Active {
		active = "a relay streams from it"
	}
	if !c.BacklogDone {
		backlog = "rows from before the slot: still being published"
	}
	fmt.Fprintf(w, "capture  wal  slot %s  %s  lag %d bytes, not moving for %s  wal_status %s  %s\n",
		c.Slot.Name, active, c.Slot.LagBytes, c.Slot.Stuck.Round(time.Second), c.Slot.WALStatus, backlog)
}

// printAudits prints the newest audits of the stream against the outbox.
func printAudits(w io.Writer, audits []outboxstore.Audit) {
	if len(audits) == 0 {
		fmt.Fprintf(w, "audit    none yet (the relays audit the stream against the outbox: relay.audit)\n")
	}
	for i, a := range audits {
		label := "audit   "
		if i > 0 {
			label = "  missed"
		}
		found := "nothing missing"
		if a.Missing > 0 {
			found = fmt.Sprintf("%d MISSING, %d published again", a.Missing, a.Repaired)
		}
		if a.Detail != "" {
			found += " (" + a.Detail + ")"
		}
		fmt.Fprintf(w, "%s %s %s ago: %s, %d events checked: %s\n", label, a.Kind, time.Since(a.FinishedAt).Round(time.Second), a.Scope, a.Checked, found)
	}
}

// printStream prints the events stream's size and owner.
func printStream(w io.Writer, st operator.Status) {
	if st.Stream.Missing {
		fmt.Fprintf(w, "stream   %s  not created yet (the relay creates it at start unless stream.provision is verify or off)\n\n", st.Stream.Name)
		return
	}
	owner := st.Stream.Owner
	switch {
	case owner == "":
		owner = "none recorded"
	case st.Stream.Foreign:
		owner += " (ANOTHER DATABASE: this database's relays refuse to publish into it)"
	}
	fmt.Fprintf(w, "stream   %s  %d messages  %d bytes  seq %d..%d  owner %s\n\n", st.Stream.Name, st.Stream.Messages, st.Stream.Bytes, st.Stream.FirstSeq, st.Stream.LastSeq, owner)
}

// printSubscribers prints a row for each subscriber, and the aggregates
// held behind their dead letters.
func printSubscribers(w io.Writer, subs []operator.SubscriberStatus) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SUBSCRIBER\tPENDING\tACK PENDING\tREDELIVERED\tCHECKPOINT\tDEAD LETTERS")
	for _, s := range subs {
		pending := fmt.Sprint(s.Pending)
		if s.ConsumerGone {
			pending = "(no consumer)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\n", s.Name, pending, s.AckPending, s.Redelivered, s.Checkpoint, s.DeadLetters)
	}
	tw.Flush()
	for _, s := range subs {
		if s.HeldAggregates > 0 {
			fmt.Fprintf(w, "held     %s: %d aggregates wait behind a dead-lettered event (subscribers.on_dead_letter hold): fanout dlq list --subscriber %s shows which\n",
				s.Name, s.HeldAggregates, s.Name)
		}
	}
}

func printBackfill(w io.Writer, b operator.Backfill) {
	state := "running"
	switch {
	case b.FinishedAt != nil:
		state = "finished " + time.Since(*b.FinishedAt).Round(time.Second).String() + " ago"
	case b.Paused:
		state = "PAUSED (fanout backfill " + b.Subscriber + " --resume)"
	case time.Since(b.UpdatedAt) > time.Minute:
		state = "stopped " + time.Since(b.UpdatedAt).Round(time.Second).String() + " ago (fanout backfill " + b.Subscriber + " resumes it)"
	}
	where := ""
	if b.Where != "" {
		where = "  where " + b.Where
	}
	fmt.Fprintf(w, "backfill %s: %s, %d/%d rows, %d failed (subscriber_backfill_failures), %d of %d segments done, started %s ago%s\n",
		b.Subscriber, state, b.Done, b.Total, b.Failed, b.SegmentsDone, b.Segments, time.Since(b.StartedAt).Round(time.Second), where)
}

// stageNames are the stages as status prints them.
var stageNames = map[string]string{
	metrics.StagePublished:  "commit → PubAck",
	metrics.StageDelivered:  "PubAck → delivered",
	metrics.StageHandled:    "delivered → handled",
	metrics.StageSearchable: "handled → searchable",
}

func printStages(w io.Writer, st operator.Stages) {
	fmt.Fprintf(w, "\nlatency by stage, last minute (from %s)\n", strings.Join(st.From, ", "))
	for _, u := range st.Unreachable {
		fmt.Fprintf(w, "  not read: %s\n", u)
	}
	if len(st.Unreachable) > 0 {
		fmt.Fprintln(w, "  (set http.peers, FANOUT_HTTP_PEERS, to the running roles' http.addr: host:port,...)")
	}
	if len(st.Latencies) == 0 {
		fmt.Fprintln(w, "  no events in the last minute")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STAGE\tSUBSCRIBER\tEVENTS\tP50\tP99")
	for _, l := range st.Latencies {
		name := stageNames[l.Stage]
		if name == "" {
			name = l.Stage
		}
		sub := l.Subscriber
		if sub == "" {
			sub = "(relay)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", name, sub, l.Events, fmtMs(l.P50Ms), fmtMs(l.P99Ms))
	}
	tw.Flush()
}

// fmtMs prints milliseconds with the precision that matters at their size.
func fmtMs(ms float64) string {
	switch {
	case ms < 10:
		return fmt.Sprintf("%.1fms", ms)
	case ms < 10000:
		return fmt.Sprintf("%.0fms", ms)
	default:
		return fmt.Sprintf("%.1fs", ms/1000)
	}
}

// printReplay prints a replay request of the last day and what came of it.
func printReplay(w io.Writer, r bookkeeping.ReplayRecord) {
	fmt.Fprintf(w, "replay   %d: %s from sequence %d of %s, asked by %s at %s", r.ID, r.Subscriber, r.FromSeq, r.Stream, r.RequestedBy, r.RequestedAt.Local().Format(time.DateTime))
	if r.Reason != "" {
		fmt.Fprintf(w, " (%s)", r.Reason)
	}
	switch r.Outcome {
	case bookkeeping.ReplayRequested:
		fmt.Fprintf(w, ": waiting for a running instance of %s to take it\n", r.Subscriber)
	case bookkeeping.ReplayLapsed:
		fmt.Fprintln(w, ": lapsed with no outcome recorded (no instance took it, or one failed carrying it out: see its log)")
	default:
		fmt.Fprintf(w, ": %s, recorded by %s\n", r.Outcome, r.By)
	}
}
