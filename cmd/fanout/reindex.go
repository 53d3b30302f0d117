package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
)

// onSearch makes a reindex command's RunE: fn runs connected to Postgres
// and the engine, and if exclusive() holds with the reindex lock of the
// alias taken (searchindex.Lock); all are released after it.
func onSearch(a *app, exclusive func() bool, fn func(cmd *cobra.Command, pool *pgxpool.Pool, client *search.Client) error) func(*cobra.Command, []string) error {
	return a.connected("reindex", pgOnly, func(cmd *cobra.Command, _ []string, c *conns) error {
		if exclusive() {
			unlock, err := searchindex.Lock(cmd.Context(), c.pool, a.cfg.Search.Alias)
			if err != nil {
				return err
			}
			defer unlock()
		}
		// Minutes of work should not be lost to an engine that is slow or
		// restarting for a moment: each request waits the outage out.
		cfg := a.cfg.Search.Client()
		logger := logging.Component(a.logger, "reindex")
		cfg.OnOutage = func(err error, wait time.Duration) {
			logger.Warn("search engine unavailable, retrying", "error", err, "retry_in", wait.Round(time.Millisecond))
		}
		client, err := search.Connect(cmd.Context(), cfg)
		if err != nil {
			return err
		}
		defer client.Close()
		return fn(cmd, c.pool, client)
	})
}

// locked is onSearch's exclusive for the commands that always change the
// index.
func locked() bool { return true }

func reindexCommand(a *app) *cobra.Command {
	var check, repair bool
	var loaders int
	cmd := &cobra.Command{
		Use:   "reindex",
		Short: "Build a new search index from SQL and swap the alias to it, with no downtime and no lost update",
		Long: `reindex creates <alias>-v<N+1> from the mapping in schema/, bulk-loads it from
one SQL snapshot (refresh off, a progress bar with docs/s and ETA), applies the
events that arrived meanwhile, verifies counts and a sample of documents against
SQL, and swaps the alias atomically. The old index is kept: ` + "`fanout reindex rollback`" + `
returns to it, ` + "`fanout reindex cleanup`" + ` deletes it.

--check compares SQL with the index (counts and every document) and reports
drift; --check --repair fixes it, and names every document it could not fix
and why (a version above SQL's, a document the mapping rejects), then exits
non-zero.`,
		Args: cobra.NoArgs,
		// A plain --check only reads; everything else changes the index.
		RunE: onSearch(a, func() bool { return !check || repair }, func(cmd *cobra.Command, pool *pgxpool.Pool, client *search.Client) error {
			if check {
				return reindexCheck(cmd, a, pool, client, repair)
			}
			return reindexBuild(cmd, a, pool, client, loaders)
		}),
	}
	cmd.Flags().BoolVar(&check, "check", false, "compare SQL with the index (counts and every document) and report drift")
	cmd.Flags().BoolVar(&repair, "repair", false, "with --check: write the SQL state of every drifted document, read it back and report what is still wrong")
	cmd.Flags().IntVar(&loaders, "loaders", 3, "bulk requests in flight during the load")
	cmd.AddCommand(reindexRollbackCommand(a), reindexCleanupCommand(a))
	return cmd
}

// reindexCheck compares SQL with the index the alias points at, and with
// repair fixes the documents that drifted.
func reindexCheck(cmd *cobra.Command, a *app, pool *pgxpool.Pool, client *search.Client, repair bool) error {
	ctx := cmd.Context()
	out := cmd.OutOrStdout()
	current, err := searchindex.Current(ctx, client, a.cfg.Search.Alias)
	if err != nil {
		return err
	}
	if current == "" {
		return fmt.Errorf("alias %s points at no index", a.cfg.Search.Alias)
	}
	_ = client.Refresh(ctx, current)
	drift, err := searchindex.Check(ctx, client, pool, current, 0)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%s (%s): %s\n", a.cfg.Search.Alias, current, drift)
	if drift.Total() == 0 {
		fmt.Fprintln(out, "no drift")
		return nil
	}
	if !repair {
		return fmt.Errorf("%d documents drifted (run with --repair to fix them)", drift.Total())
	}
	rep, err := searchindex.Repair(ctx, client, pool, current, a.cfg.Search.BulkSize, drift)
	printRepair(out, rep)
	return repairError(err, rep)
}

// reindexBuild builds the next index version from SQL and swaps the alias
// to it (searchindex.Reindexer).
func reindexBuild(cmd *cobra.Command, a *app, pool *pgxpool.Pool, client *search.Client, loaders int) error {
	nc, js, err := a.jetStream("reindex")
	if err != nil {
		return err
	}
	defer nc.Close()
	r := &searchindex.Reindexer{Client: client, Pool: pool, JS: js, Stream: a.cfg.Stream, Search: a.cfg.Search,
		Logger: logging.Component(a.logger, "reindex"), Progress: os.Stderr, Loaders: loaders}
	rep, err := r.Reindex(cmd.Context())
	if err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "reindexed %d of %d products into %s in %s (load %.0f docs/s), %d failed, %d events replayed; alias %s now points at %s (previous: %q, kept)\n",
		rep.Loaded, rep.Snapshot, rep.To, rep.TotalTime.Round(time.Millisecond), rep.DocsPerSec, len(rep.Failures), rep.Replayed, a.cfg.Search.Alias, rep.To, rep.From)
	return nil
}

func reindexRollbackCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "rollback",
		Short: "Point the alias back at the previous index, then repair what it missed since the swap",
		Args:  cobra.NoArgs,
		RunE: onSearch(a, locked, func(cmd *cobra.Command, pool *pgxpool.Pool, client *search.Client) error {
			from, to, rep, err := searchindex.Rollback(cmd.Context(), client, pool, a.cfg.Search)
			out := cmd.OutOrStdout()
			if to != "" && (err == nil || rep.Drifted > 0) {
				// The alias moved; say so even if the repair fell short.
				fmt.Fprintf(out, "alias %s now points at %s (was %s); %d documents it had missed\n", a.cfg.Search.Alias, to, from, rep.Drifted)
				printRepair(out, rep)
				return repairError(err, rep)
			}
			return err
		}),
	}
}

func reindexCleanupCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "cleanup",
		Short: "Delete every index version the alias does not point at",
		Args:  cobra.NoArgs,
		// Locked too: the index a running reindex loads is one the alias
		// does not point at yet.
		RunE: onSearch(a, locked, func(cmd *cobra.Command, _ *pgxpool.Pool, client *search.Client) error {
			deleted, err := searchindex.Cleanup(context.WithoutCancel(cmd.Context()), client, a.cfg.Search.Alias)
			fmt.Fprintf(cmd.OutOrStdout(), "deleted %v\n", deleted)
			return err
		}),
	}
}

// printRepair reports what a repair fixed and, one line each, what it could
// not fix and why. The command's error (and exit status) says it too.
func printRepair(out io.Writer, rep searchindex.RepairReport) {
	fmt.Fprintf(out, "repaired %d of %d drifted documents\n", rep.Fixed, rep.Drifted)
	if len(rep.Unrepaired) == 0 {
		return
	}
	fmt.Fprintf(out, "could not repair %d documents:\n", len(rep.Unrepaired))
	for _, u := range rep.Unrepaired {
		fmt.Fprintf(out, "  document %s: %s\n", u.ID, u.Reason)
	}
}

// repairError shortens a repair's ErrNotRepaired, whose documents and
// reasons printRepair has just listed.
func repairError(err error, rep searchindex.RepairReport) error {
	if errors.Is(err, searchindex.ErrNotRepaired) {
		return fmt.Errorf("%d of %d drifted documents could not be repaired (listed above)", len(rep.Unrepaired), rep.Drifted)
	}
	return err
}
