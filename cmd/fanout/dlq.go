package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/operator"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

// dlqEnv is what the dead-letter commands work with.
type dlqEnv struct {
	*operator.DeadLetters
	pool *pgxpool.Pool
	nc   *nats.Conn
}

func openDLQ(ctx context.Context, a *app) (*dlqEnv, error) {
	if err := a.load(); err != nil {
		return nil, err
	}
	pool, err := a.postgres(ctx, "dlq")
	if err != nil {
		return nil, err
	}
	nc, err := a.nats("dlq")
	if err != nil {
		pool.Close()
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err == nil {
		var d *operator.DeadLetters
		if d, err = operator.OpenDeadLetters(ctx, pool, js, a.cfg.Stream, a.cfg.Subscribers); err == nil {
			return &dlqEnv{DeadLetters: d, pool: pool, nc: nc}, nil
		}
	}
	nc.Close()
	pool.Close()
	return nil, err
}

func (e *dlqEnv) close() {
	e.nc.Close()
	e.pool.Close()
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

// comment is what the audit trail records beside the database role that
// acted (the actor, which the database records itself): the operator's
// reason, and the deprecated --actor's words if given.
func comment(reason, actor string) string {
	if actor != "" {
		return strings.TrimSpace(reason + " (--actor " + actor + ")")
	}
	return reason
}

func dlqCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List, show, redrive or discard dead letters",
	}
	var subscriber, actor, reason string
	var fromLetter, all bool
	list := &cobra.Command{
		Use:   "list",
		Short: "List dead letters (of one subscriber with --subscriber)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.List(ctx, subscriber)
			if err != nil {
				return err
			}
			shown := ds
			if !all {
				shown = operator.Unresolved(ds)
			}
			// An ordered subscriber's letter names the events held behind it.
			holds := map[string][]string{}
			for _, d := range operator.Unresolved(ds) {
				if d.HeldBy != "" {
					holds[d.Subscriber+"/"+d.HeldBy] = append(holds[d.Subscriber+"/"+d.HeldBy], d.EventID)
				}
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "SEQ\tSUBSCRIBER\tEVENT\tTYPE\tDELIVERIES\tDEAD AT\tREASON")
			for _, d := range shown {
				reason := truncate(d.Reason, 100)
				switch {
				case d.Refused != "":
					reason = "REFUSED (" + truncate(d.Refused, 160) + ")"
				case d.Resolved != "":
					reason = "RESOLVED: " + d.Resolved + " (" + truncate(d.Reason, 60) + ")"
				case d.HeldBy != "":
					reason = "HELD behind event " + d.HeldBy + ": redrive or discard it first, then this one"
				}
				if held := holds[d.Subscriber+"/"+d.EventID]; len(held) > 0 && d.Resolved == "" {
					reason = fmt.Sprintf("HOLDS events %s of its aggregate; %s", strings.Join(held, ", "), reason)
				}
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", d.Seq, d.Subscriber, d.EventID, d.EventType, d.Deliveries, d.At, reason)
			}
			tw.Flush()
			fmt.Fprintf(cmd.OutOrStdout(), "%d dead letters to resolve (%d resolved, kept until they age out: --all lists them)\n", len(operator.Unresolved(ds)), len(ds)-len(operator.Unresolved(ds)))
			return nil
		},
	}
	list.Flags().StringVar(&subscriber, "subscriber", "", "only this subscriber's dead letters")
	list.Flags().BoolVar(&all, "all", false, "also the letters already resolved")

	show := &cobra.Command{
		Use:   "show <seq>",
		Short: "Show a dead letter: its headers (subscriber, reason, deliveries, original subject) and body",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.targets(ctx, args, "")
			if err != nil {
				return err
			}
			m := ds[0].Raw
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "seq %d, subject %s, stored %s\n", m.Sequence, m.Subject, m.Time.UTC().Format(time.RFC3339))
			for k, vs := range m.Header {
				fmt.Fprintf(w, "%s: %s\n", k, strings.Join(vs, ", "))
			}
			fmt.Fprintf(w, "\n%s\n", m.Data)
			return nil
		},
	}

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
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.targets(ctx, args, subscriber)
			if err != nil {
				return err
			}
			d := &deps{a: a, ctx: ctx, pool: e.pool, reg: nil}
			defer d.close()
			runners := map[string]*subscribers.Runner{}
			// runnerOf builds the subscriber's handler, in this process,
			// the first time one of its letters is redriven.
			runnerOf := func(name string) (*subscribers.Runner, error) {
				if r, ok := runners[name]; ok {
					return r, nil
				}
				decl, err := subscriberRegistry.Lookup(name)
				if err != nil {
					return nil, fmt.Errorf("dead letters of %q: this binary knows no such subscriber", name)
				}
				h, err := d.build(decl)
				if err != nil {
					return nil, err
				}
				r, err := subscribers.New(subscribers.Options{Handler: h, Config: a.cfg.Subscriber(name), Stream: a.cfg.Stream,
					Pool: e.pool, Conn: e.nc, Logger: logging.Component(a.logger, "dlq")})
				if err != nil {
					return nil, err
				}
				runners[name] = r
				return r, nil
			}
			done, err := e.Redrive(ctx, ds, runnerOf, fromLetter, comment(reason, actor))
			failed := 0
			for _, r := range done {
				l := r.Letter
				from := ""
				if r.Source != "" {
					from = ", from " + r.Source
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%d (%s, event %s%s): %s\n", l.Seq, l.Subscriber, l.EventID, from, r.Outcome)
				if r.Err != nil {
					failed++
				}
			}
			if err != nil {
				return err
			}
			if failed > 0 {
				return fmt.Errorf("%d of %d redrives failed; their dead letters remain to be resolved", failed, len(ds))
			}
			return nil
		},
	}
	redrive.Flags().StringVar(&subscriber, "subscriber", "", "redrive every dead letter of this subscriber")
	redrive.Flags().BoolVar(&fromLetter, "from-letter", false, "for an event neither the outbox nor the events stream holds any more: trust the dead letter's own copy, if its subscriber vouched for it")
	redrive.Flags().StringVar(&reason, "reason", "", "why (recorded in the audit trail beside the database role that acts)")
	redrive.Flags().StringVar(&actor, "actor", "", "who is redriving (recorded as a comment)")
	_ = redrive.Flags().MarkDeprecated("actor", "the audit trail records the database role that acts; say more with --reason")

	discard := &cobra.Command{
		Use:   "discard <seq> | --subscriber S",
		Short: "Resolve dead letters without handling them (recorded in dead_letter_actions; the letters stay until they age out)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.targets(ctx, args, subscriber)
			if err != nil {
				return err
			}
			n, left, err := e.Discard(ctx, ds, comment(reason, actor))
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
		},
	}
	discard.Flags().StringVar(&subscriber, "subscriber", "", "discard every dead letter of this subscriber")
	discard.Flags().StringVar(&reason, "reason", "", "why (recorded in the audit trail beside the database role that acts; needed for a letter no subscriber vouches for)")
	discard.Flags().StringVar(&actor, "actor", "", "who is discarding (recorded as a comment)")
	_ = discard.Flags().MarkDeprecated("actor", "the audit trail records the database role that acts; say more with --reason")

	cmd.AddCommand(list, show, redrive, discard)
	return cmd
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
