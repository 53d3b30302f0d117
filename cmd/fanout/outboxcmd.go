package main

import (
	"errors"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/spf13/cobra"
)

func outboxCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "outbox",
		Short: "Operate on outbox rows: retry or skip failed ones, republish published ones; register another database's events; declare who writes which event types",
	}
	cmd.AddCommand(outboxRetryFailedCommand(a), outboxSkipCommand(a), numberingCommand(a), outboxRepublishCommand(a), allowOriginCommand(a), writersCommand(a))
	return cmd
}

func outboxRetryFailedCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "retry-failed",
		Short: "Return every failed row to pending (after fixing what made it fail)",
		Args:  cobra.NoArgs,
		RunE: a.connected("outbox", pgOnly, func(cmd *cobra.Command, _ []string, c *conns) error {
			n, err := outboxstore.New(c.pool).RetryFailed(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d failed rows returned to pending\n", n)
			return nil
		}),
	}
}

func outboxRepublishCommand(a *app) *cobra.Command {
	var since string
	republish := &cobra.Command{
		Use:   "republish --since TIME",
		Short: "Publish again the rows still retained, published since TIME (after a broker lost data)",
		Long: `republish returns the rows published at or after --since (RFC 3339, or a
duration such as 30m meaning that long ago) to pending, so the relays publish
them again. Use it after the broker lost acknowledged messages (a single
server's power loss, a stream restored from an old backup). Only rows still
retained are covered (relay.sent_retention, 1 hour by default). Messages the
stream still has inside its duplicates window are dropped by JetStream; the
rest are stored again, and each subscriber's checkpoint absorbs the events it
had already handled.

While the relays capture from the WAL (relay.capture wal), the rows they
published stay pending in the table, with no publish time: they are taken by
created_at, when their writer's transaction began, a moment before the slot
decoded them (set --since earlier by the slot's lag at the time of the loss,
which fanout status shows). The wal relay publishes each one again as it
decodes the update that returns it.`,
		Args: cobra.NoArgs,
		// A configuration's error is reported before --since's (open then
		// finds it loaded).
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
			t, err := parseSince(since)
			if err != nil {
				return err
			}
			c, err := a.open(cmd.Context(), "outbox", pgOnly)
			if err != nil {
				return err
			}
			defer c.close()
			n, oldest, err := outboxstore.New(c.pool).Republish(cmd.Context(), t)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d rows published since %s returned to pending for the relays to publish again\n", n, t.UTC().Format(time.RFC3339))
			if oldest != nil && oldest.After(t) {
				fmt.Fprintf(cmd.OutOrStdout(), "note: the oldest published row retained is from %s; events published before that are no longer in the outbox\n", oldest.UTC().Format(time.RFC3339))
			}
			return nil
		}),
	}
	republish.Flags().StringVar(&since, "since", "", "RFC 3339 time, or a duration ago (e.g. 30m)")
	_ = republish.MarkFlagRequired("since")
	return republish
}

func outboxSkipCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "skip ID...",
		Short: "Give up on failed rows: never publish them, and release the events of their aggregates held behind them",
		Long: `skip marks the failed rows named by their ids skipped: they are never
published, and no longer hold the later events of their aggregates
(relay.on_failed hold), which the relays then publish in order. Use it for an
event that can never be published and that the subscribers can do without;
fix and retry the others (outbox retry-failed). fanout status shows what is
held, and the failed rows' reasons are in the outbox's last_error column.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ids, err := outboxRowIDs(args)
			if err != nil {
				return err
			}
			c, err := a.open(cmd.Context(), "outbox", pgOnly)
			if err != nil {
				return err
			}
			defer c.close()
			skipped, err := outboxstore.New(c.pool).Skip(cmd.Context(), ids)
			if err != nil {
				return err
			}
			return reportSkipped(cmd.OutOrStdout(), ids, skipped)
		},
	}
}

// outboxRowIDs parses outbox skip's arguments.
func outboxRowIDs(args []string) ([]int64, error) {
	ids := make([]int64, len(args))
	for i, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id <= 0 {
			return nil, fmt.Errorf("outbox skip: %q is not an outbox row id", a)
		}
		ids[i] = id
	}
	return ids, nil
}

// reportSkipped prints the rows skipped, and fails if one of ids was not.
func reportSkipped(w io.Writer, ids []int64, skipped []outboxstore.Skipped) error {
	done := map[int64]bool{}
	for _, s := range skipped {
		done[s.ID] = true
		fmt.Fprintf(w, "row %d skipped; %d events held behind it returned to the relays\n", s.ID, s.Released)
	}
	var missed []string
	for _, id := range ids {
		if !done[id] {
			missed = append(missed, strconv.FormatInt(id, 10))
		}
	}
	if len(missed) > 0 {
		return fmt.Errorf("outbox skip: no failed row with id %s (only failed rows can be skipped)", strings.Join(missed, ", "))
	}
	return nil
}

func parseSince(s string) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return time.Now().Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("--since %q: want an RFC 3339 time (2026-01-02T15:04:05Z) or a duration ago (30m)", s)
	}
	return t, nil
}

func numberingCommand(a *app) *cobra.Command {
	var skip []string
	var all bool
	cmd := &cobra.Command{
		Use:   "numbering [--skip TYPE,... | --all]",
		Short: "Show or set the event types the outbox does not number in their aggregate (a cheaper insert, no per-aggregate order)",
		Long: `The outbox numbers each event in its aggregate (aggregate_seq), which ordered
subscribers need and which costs every insert a trigger call and a counter
update: about 8 points of a writer's transactions per second. --skip lists the
event types that need no number: none of the known ordered subscribers may read
one, by name or through a pattern (an ordered subscriber that does refuses to
start, or, running, reports not ready). Their events are
published without Fanout-Aggregate-Seq, outside their aggregate's order, and
relay.on_failed hold does not hold behind them. --all numbers every event
again, as a new database does. The list replaces the last one, from the next
insert on. It needs the outbox's owner (the credentials fanout migrate uses).
Without a flag, it shows the list.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			setting := cmd.Flags().Changed("skip") || all
			if cmd.Flags().Changed("skip") && all {
				return errors.New("outbox numbering: --skip and --all are two different lists; give one")
			}
			if cmd.Flags().Changed("skip") {
				if len(skip) == 0 {
					return errors.New("outbox numbering: --skip needs at least one event type (--all numbers every event)")
				}
				for _, t := range skip {
					if err := outbox.ValidEventType(t); err != nil {
						return fmt.Errorf("outbox numbering: %w", err)
					}
				}
				if err := readByOrderedSubscriber(subscriberRegistry.All(), skip); err != nil {
					return err
				}
			}
			c, err := a.open(cmd.Context(), "migrate", pgOnly)
			if err != nil {
				return err
			}
			defer c.close()
			store := outboxstore.New(c.pool)
			if setting {
				if err := store.SetNumbering(cmd.Context(), skip); err != nil {
					return fmt.Errorf("outbox numbering: %w", err)
				}
			}
			types, err := store.Unnumbered(cmd.Context())
			if err != nil {
				return err
			}
			if len(types) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "every event is numbered in its aggregate")
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "every event is numbered in its aggregate except those of type %s\n", strings.Join(types, ", "))
			}
			return nil
		},
	}
	cmd.Flags().StringSliceVar(&skip, "skip", nil, "event types not to number, comma-separated (as CSV: quote a type that holds a comma, --skip '\"a,b\",c'); replaces the list")
	cmd.Flags().BoolVar(&all, "all", false, "number every event again")
	return cmd
}

// readByOrderedSubscriber refuses a list of event types not to number
// that an ordered subscriber of decls (those this binary knows) reads, by
// name or through a pattern.
func readByOrderedSubscriber(decls []subscribers.Declaration, skip []string) error {
	var reads []string
	for _, d := range decls {
		if !d.Ordered {
			continue
		}
		for _, p := range d.EventTypes {
			for _, t := range skip {
				switch {
				case p == t:
					reads = append(reads, fmt.Sprintf("%s (read by %s, an ordered subscriber)", t, d.Name))
				case stream.SubjectMatches(p, t):
					reads = append(reads, fmt.Sprintf("%s (read by %s, an ordered subscriber, through %s)", t, d.Name, p))
				}
			}
		}
	}
	if len(reads) > 0 {
		return fmt.Errorf("outbox numbering: --skip names %s; ordered subscribers need every event they read numbered", strings.Join(reads, ", "))
	}
	return nil
}

func allowOriginCommand(a *app) *cobra.Command {
	var reason string
	cmd := &cobra.Command{
		Use:   "allow-origin SYSTEM/DATABASE --reason TEXT",
		Short: "Register another database whose relays publish into the same stream: the subscribers take its events",
		Long: `allow-origin registers a database by its system identifier and name (as the
Fanout-Origin header of its events names it: SYSTEM/DATABASE/EPOCH; the
database's own relay logs it at start). The subscribers number the origins of
a registered database's events (at most 100 of its epochs) and dead-letter
the events of any other database, naming it: a role cannot take the origin
numbers every subscriber shares with made-up origins. This database's own
epochs need no registration. Redrive the dead letters after registering.`,
		Args: cobra.ExactArgs(1),
		RunE: a.connected("outbox", pgOnly, func(cmd *cobra.Command, args []string, c *conns) error {
			system, escaped, ok := strings.Cut(args[0], "/")
			sys, err := strconv.ParseUint(system, 10, 64)
			name, nameErr := url.PathUnescape(escaped)
			if !ok || err != nil || nameErr != nil || name == "" || strings.Contains(escaped, "/") {
				return fmt.Errorf("outbox allow-origin: %q is not SYSTEM/DATABASE (a system identifier, a slash, a database name)", args[0])
			}
			if strings.TrimSpace(reason) == "" {
				return errors.New("outbox allow-origin: --reason is required (it is recorded with the database)")
			}
			added, err := outboxstore.New(c.pool).AllowOrigin(cmd.Context(), outbox.Database{System: sys, Name: name}, reason)
			if err != nil {
				return err
			}
			if added {
				fmt.Fprintf(cmd.OutOrStdout(), "database %s registered: its events' origins are numbered\n", args[0])
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "database %s was registered already\n", args[0])
			}
			return nil
		}),
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why its events belong here (recorded)")
	return cmd
}
