package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/operator"
	"github.com/fanout/fanout/subscribers"
	"github.com/spf13/cobra"
)

// dlqEnv is what the dead-letter commands work with.
type dlqEnv struct {
	*operator.DeadLetters
	*conns
}

// targets resolves `<seq>` or `--subscriber S` into dead letters: the
// subscriber's unresolved ones, or the one at seq.
func (e *dlqEnv) targets(ctx context.Context, args []string, subscriber string) ([]operator.Letter, error) {
	if (len(args) == 1) == (subscriber != "") {
		return nil, errors.New("give either a dead letter's sequence number or --subscriber")
	}
	if subscriber != "" {
		ls, err := e.List(ctx, subscriber)
		return operator.Unresolved(ls), err
	}
	seq, err := strconv.ParseUint(args[0], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%q is not a sequence number (see `fanout dlq list`)", args[0])
	}
	l, err := e.Get(ctx, seq)
	if err != nil {
		return nil, err
	}
	return []operator.Letter{l}, nil
}

func dlqCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List, show, redrive or discard dead letters",
	}
	cmd.AddCommand(dlqListCommand(a), dlqShowCommand(a), dlqRedriveCommand(a), dlqDiscardCommand(a))
	return cmd
}

// onDLQ makes a dead-letter subcommand's RunE: fn runs with the dead
// letters open, and they are closed after it.
func onDLQ(a *app, fn func(cmd *cobra.Command, e *dlqEnv, args []string) error) func(*cobra.Command, []string) error {
	return a.connected("dlq", withNATS, func(cmd *cobra.Command, args []string, c *conns) error {
		d, err := operator.OpenDeadLetters(cmd.Context(), c.pool, c.js, a.cfg.Stream, a.cfg.Subscribers)
		if err != nil {
			return err
		}
		return fn(cmd, &dlqEnv{DeadLetters: d, conns: c}, args)
	})
}

// onLetters is onDLQ for the subcommands that act on `<seq>` or
// `--subscriber S` (targets): fn gets those letters.
func onLetters(a *app, subscriber *string, fn func(cmd *cobra.Command, e *dlqEnv, ds []operator.Letter) error) func(*cobra.Command, []string) error {
	return onDLQ(a, func(cmd *cobra.Command, e *dlqEnv, args []string) error {
		ds, err := e.targets(cmd.Context(), args, *subscriber)
		if err != nil {
			return err
		}
		return fn(cmd, e, ds)
	})
}

// letterAction is what redrive and discard share: the letters they act on
// (a sequence number, or a subscriber's), and what the audit trail records
// beside the database role that acts.
type letterAction struct {
	subscriber, reason, actor string
}

// addFlags adds --subscriber, --reason and the deprecated --actor to cmd,
// whose verb is doing ("redriving").
func (l *letterAction) addFlags(cmd *cobra.Command, subscriberHelp, reasonHelp, doing string) {
	cmd.Flags().StringVar(&l.subscriber, "subscriber", "", subscriberHelp)
	cmd.Flags().StringVar(&l.reason, "reason", "", reasonHelp)
	cmd.Flags().StringVar(&l.actor, "actor", "", "who is "+doing+" (recorded as a comment)")
	_ = cmd.Flags().MarkDeprecated("actor", "the audit trail records the database role that acts; say more with --reason")
}

// comment is what the audit trail records beside the database role that
// acted (the actor, which the database records itself): the operator's
// reason, and the deprecated --actor's words if given.
func (l *letterAction) comment() string {
	if l.actor != "" {
		return strings.TrimSpace(l.reason + " (--actor " + l.actor + ")")
	}
	return l.reason
}

func dlqListCommand(a *app) *cobra.Command {
	var subscriber string
	var all bool
	list := &cobra.Command{
		Use:   "list",
		Short: "List dead letters (of one subscriber with --subscriber)",
		Args:  cobra.NoArgs,
		RunE: onDLQ(a, func(cmd *cobra.Command, e *dlqEnv, _ []string) error {
			ds, err := e.List(cmd.Context(), subscriber)
			if err != nil {
				return err
			}
			printLetters(cmd.OutOrStdout(), ds, all)
			return nil
		}),
	}
	list.Flags().StringVar(&subscriber, "subscriber", "", "only this subscriber's dead letters")
	list.Flags().BoolVar(&all, "all", false, "also the letters already resolved")
	return list
}

// printLetters lists ds, the resolved ones too if all, and counts them.
func printLetters(w io.Writer, ds []operator.Letter, all bool) {
	unresolved := operator.Unresolved(ds)
	shown := ds
	if !all {
		shown = unresolved
	}
	// An ordered subscriber's letter names the events held behind it.
	holds := map[string][]string{}
	for _, d := range unresolved {
		if d.HeldBy != "" {
			holds[d.Subscriber+"/"+d.HeldBy] = append(holds[d.Subscriber+"/"+d.HeldBy], d.EventID)
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tSUBSCRIBER\tEVENT\tTYPE\tDELIVERIES\tDEAD AT\tREASON")
	for _, d := range shown {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", d.Seq, d.Subscriber, d.EventID, d.EventType, d.Deliveries, d.At, letterState(d, holds[d.Subscriber+"/"+d.EventID]))
	}
	tw.Flush()
	fmt.Fprintf(w, "%d dead letters to resolve (%d resolved, kept until they age out: --all lists them)\n", len(unresolved), len(ds)-len(unresolved))
}

// letterState is the REASON column: the letter's reason, or what keeps it
// from being handled, and the events of its aggregate it holds (held).
func letterState(d operator.Letter, held []string) string {
	reason := truncate(d.Reason, 100)
	switch {
	case d.Refused != "":
		reason = "REFUSED (" + truncate(d.Refused, 160) + ")"
	case d.Resolved != "":
		reason = "RESOLVED: " + d.Resolved + " (" + truncate(d.Reason, 60) + ")"
	case d.HeldBy != "":
		reason = "HELD behind event " + d.HeldBy + ": redrive or discard it first, then this one"
	}
	if len(held) > 0 && d.Resolved == "" {
		reason = fmt.Sprintf("HOLDS events %s of its aggregate; %s", strings.Join(held, ", "), reason)
	}
	return reason
}

func dlqShowCommand(a *app) *cobra.Command {
	noSubscriber := "" // show takes a sequence number only
	return &cobra.Command{
		Use:   "show <seq>",
		Short: "Show a dead letter: its headers (subscriber, reason, deliveries, original subject) and body",
		Args:  cobra.ExactArgs(1),
		RunE: onLetters(a, &noSubscriber, func(cmd *cobra.Command, _ *dlqEnv, ds []operator.Letter) error {
			m := ds[0].Raw
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "seq %d, subject %s, stored %s\n", m.Sequence, m.Subject, m.Time.UTC().Format(time.RFC3339))
			for k, vs := range m.Header {
				fmt.Fprintf(w, "%s: %s\n", k, strings.Join(vs, ", "))
			}
			fmt.Fprintf(w, "\n%s\n", m.Data)
			return nil
		}),
	}
}

func dlqRedriveCommand(a *app) *cobra.Command {
	var act letterAction
	var fromLetter bool
	redrive := &cobra.Command{
		Use:   "redrive <seq> | --subscriber S",
		Short: "Hand dead letters back to their subscriber only: run its handler once more; on success the letter is resolved",
		Long: `redrive runs the dead letter's own subscriber's handler on the event, in this
process, with the subscriber's checkpoint (an event it already handled is not
handled twice). No other subscriber sees the event again. On success the
letter is resolved (the dead-letter stream denies deletes: it stays, marked
resolved, until it ages out); on failure it stays to be resolved, and the
error is printed. Every attempt is recorded in the dead_letter_actions table,
with the database role that ran it (give each person a login role that is a
member of fanout_operator) and --reason.

The subscriber is the one whose name the letter is stored under (a
subscriber may publish dead letters under its own name only); a letter whose
headers name another is refused. The event handed to the handler is read
from the truth: its outbox row while the outbox holds it, else the events
stream at the sequence the letter names, checked to be the same event and one
the subscriber receives. For an event both have dropped, --from-letter
trusts the letter's own copy, if its sequence is one the stream has aged out
and its subscriber vouched for it (it records every letter it writes in
dead_letters, as its own database role): a forged letter cannot make a
subscriber handle an event nobody wrote, nor checkpoint one it never
handled.`,
		Args: cobra.MaximumNArgs(1),
		RunE: onLetters(a, &act.subscriber, func(cmd *cobra.Command, e *dlqEnv, ds []operator.Letter) error {
			ctx := cmd.Context()
			runners := &redriveRunners{a: a, e: e, deps: &deps{a: a, ctx: ctx, pool: e.pool, reg: nil}, built: map[string]*subscribers.Runner{}}
			defer runners.deps.close()
			done, err := e.Redrive(ctx, ds, runners.of, fromLetter, act.comment())
			failed := printRedrives(cmd.OutOrStdout(), done)
			if err != nil {
				return err
			}
			if failed > 0 {
				return fmt.Errorf("%d of %d redrives failed; their dead letters remain to be resolved", failed, len(ds))
			}
			return nil
		}),
	}
	redrive.Flags().BoolVar(&fromLetter, "from-letter", false, "for an event neither the outbox nor the events stream holds any more: trust the dead letter's own copy, if its subscriber vouched for it")
	act.addFlags(redrive, "redrive every dead letter of this subscriber",
		"why (recorded in the audit trail beside the database role that acts)", "redriving")
	return redrive
}

// redriveRunners builds a subscriber's handler, in this process, the first
// time one of its letters is redriven.
type redriveRunners struct {
	a     *app
	e     *dlqEnv
	deps  *deps
	built map[string]*subscribers.Runner
}

func (rs *redriveRunners) of(name string) (*subscribers.Runner, error) {
	if r, ok := rs.built[name]; ok {
		return r, nil
	}
	decl, err := subscriberRegistry.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("dead letters of %q: this binary knows no such subscriber", name)
	}
	h, err := rs.deps.build(decl)
	if err != nil {
		return nil, err
	}
	r, err := subscribers.New(subscribers.Options{Declaration: decl, Handler: h, Config: rs.a.cfg.Subscriber(name), Stream: rs.a.cfg.Stream,
		Pool: rs.e.pool, Conn: rs.e.nc, Logger: logging.Component(rs.a.logger, "dlq")})
	if err != nil {
		return nil, err
	}
	rs.built[name] = r
	return r, nil
}

// printRedrives says what came of each redrive, and returns how many failed.
func printRedrives(w io.Writer, done []operator.Redriven) (failed int) {
	for _, r := range done {
		l := r.Letter
		from := ""
		if r.Source != "" {
			from = ", from " + r.Source
		}
		fmt.Fprintf(w, "%d (%s, event %s%s): %s\n", l.Seq, l.Subscriber, l.EventID, from, r.Outcome)
		if r.Err != nil {
			failed++
		}
	}
	return failed
}

func dlqDiscardCommand(a *app) *cobra.Command {
	var act letterAction
	discard := &cobra.Command{
		Use:   "discard <seq> | --subscriber S",
		Short: "Resolve dead letters without handling them (recorded in dead_letter_actions; the letters stay until they age out)",
		Args:  cobra.MaximumNArgs(1),
		RunE: onLetters(a, &act.subscriber, func(cmd *cobra.Command, e *dlqEnv, ds []operator.Letter) error {
			n, left, err := e.Discard(cmd.Context(), ds, act.comment())
			fmt.Fprintf(cmd.OutOrStdout(), "discarded %d dead letters\n", n)
			for _, why := range left {
				fmt.Fprintf(cmd.OutOrStdout(), "left %s\n", why)
			}
			if err != nil {
				return err
			}
			if len(left) > 0 {
				return fmt.Errorf("%d dead letters left: no subscriber vouches for them, and discarding them takes --reason", len(left))
			}
			return nil
		}),
	}
	act.addFlags(discard, "discard every dead letter of this subscriber",
		"why (recorded in the audit trail beside the database role that acts; needed for a letter no subscriber vouches for)", "discarding")
	return discard
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
