package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
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

func defaultActor() string {
	name := "unknown"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return name + "@" + host
}

func dlqCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List, show, redrive or discard dead letters",
	}
	var subscriber, actor string
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
error is printed. Every attempt is recorded in the dead_letter_actions table
with --actor.

The subscriber is the one whose name the letter is stored under (a
subscriber may publish dead letters under its own name only); a letter whose
headers name another is refused. The event handed to the handler is the one
in the events stream at the sequence the letter names, checked to be the
same event and one the subscriber receives: a forged letter cannot make a
subscriber checkpoint, and so skip, an event it never handled. For an event
the stream no longer holds, --from-letter trusts the letter's own copy.`,
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
			done, err := e.Redrive(ctx, ds, runnerOf, fromLetter, actor)
			failed := 0
			for _, r := range done {
				l := r.Letter
				fmt.Fprintf(cmd.OutOrStdout(), "%d (%s, event %s): %s\n", l.Seq, l.Subscriber, l.EventID, r.Outcome)
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
	redrive.Flags().BoolVar(&fromLetter, "from-letter", false, "for an event the events stream no longer holds (past stream.max_age): trust the dead letter's own copy")
	redrive.Flags().StringVar(&actor, "actor", defaultActor(), "who is redriving (recorded)")

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
			ordered := func(name string) bool {
				decl, err := subscriberRegistry.Lookup(name)
				return err == nil && decl.Ordered
			}
			n, err := e.Discard(ctx, ds, ordered, actor)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "discarded %d dead letters\n", n)
			return nil
		},
	}
	discard.Flags().StringVar(&subscriber, "subscriber", "", "discard every dead letter of this subscriber")
	discard.Flags().StringVar(&actor, "actor", defaultActor(), "who is discarding (recorded)")

	cmd.AddCommand(list, show, redrive, discard)
	return cmd
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
