package main

import (
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/spf13/cobra"
)

// writersCommand lists and changes which role may write which event
// types (outboxstore.Writers): Postgres refuses any other.
func writersCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "writers",
		Short: "List which role may write which event types; Postgres refuses an event no declaration covers",
		Long: `writers lists the declarations Postgres checks at every outbox insert: an
event is written only by a session whose login role is, or is a member of, a
role declared for its type ('*': every type). The outbox owner's session (as a
development setup writes) and a superuser's pass.

Until you declare your applications' types, fanout_writer is declared for '*'
(every writer may write every type, as before this check). Declare each
application's types, then withdraw that one:

  fanout outbox writers allow catalog_app product.created product.updated --reason "the catalog service"
  fanout outbox writers allow orders_app order.created order.paid --reason "the order service"
  fanout outbox writers withdraw fanout_writer '*'`,
		Args: cobra.NoArgs,
		RunE: a.connected("outbox", pgOnly, func(cmd *cobra.Command, _ []string, c *conns) error {
			decls, err := outboxstore.NewWriters(c.pool).List(cmd.Context())
			if err != nil {
				return err
			}
			if len(decls) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "no declarations: only the outbox owner's session and a superuser's can write events")
				return nil
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ROLE\tEVENT TYPE\tDECLARED\tBY\tREASON")
			for _, d := range decls {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", d.Writer, d.EventType, d.DeclaredAt.UTC().Format(time.RFC3339), d.DeclaredBy, d.Reason)
			}
			return tw.Flush()
		}),
	}
	cmd.AddCommand(writersAllowCommand(a), writersWithdrawCommand(a))
	return cmd
}

func writersAllowCommand(a *app) *cobra.Command {
	var reason string
	cmd := &cobra.Command{
		Use:   "allow ROLE EVENT_TYPE... --reason TEXT",
		Short: "Let a role (and its members) write these event types ('*': every type)",
		Args:  cobra.MinimumNArgs(2),
		RunE: a.connected("outbox", pgOnly, func(cmd *cobra.Command, args []string, c *conns) error {
			if len(reason) == 0 || len(reason) > 500 {
				return errors.New("outbox writers allow: --reason is required, at most 500 characters (it is recorded with the declaration)")
			}
			w := outboxstore.NewWriters(c.pool)
			for _, typ := range args[1:] {
				added, err := w.Allow(cmd.Context(), args[0], typ, reason)
				if err != nil {
					return err
				}
				if added {
					fmt.Fprintf(cmd.OutOrStdout(), "%s may write %s\n", args[0], typ)
				} else {
					fmt.Fprintf(cmd.OutOrStdout(), "%s could write %s already\n", args[0], typ)
				}
			}
			return nil
		}),
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why this role writes these types (recorded)")
	return cmd
}

func writersWithdrawCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "withdraw ROLE EVENT_TYPE...",
		Short: "Take declarations back: the role's new events of these types are refused from now on",
		Args:  cobra.MinimumNArgs(2),
		RunE: a.connected("outbox", pgOnly, func(cmd *cobra.Command, args []string, c *conns) error {
			w := outboxstore.NewWriters(c.pool)
			for _, typ := range args[1:] {
				gone, err := w.Withdraw(cmd.Context(), args[0], typ)
				if err != nil {
					return err
				}
				if gone {
					fmt.Fprintf(cmd.OutOrStdout(), "%s may no longer write %s\n", args[0], typ)
				} else {
					fmt.Fprintf(cmd.OutOrStdout(), "%s had no declaration for %s\n", args[0], typ)
				}
			}
			return nil
		}),
	}
}
