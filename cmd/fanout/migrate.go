package main

import (
	"fmt"
	"os"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/schema"
	"github.com/spf13/cobra"
)

func migrateCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply the database migrations (safe to run twice, and from several processes at once)",
		Args:  cobra.NoArgs,
		RunE: a.connected("migrate", pgOnly, func(cmd *cobra.Command, _ []string, c *conns) error {
			applied, err := schema.Migrate(cmd.Context(), c.pool, logging.Component(a.logger, "migrate"))
			if err != nil {
				return err
			}
			if len(applied) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "schema is up to date")
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "applied %d migration(s): %v\n", len(applied), applied)
			}
			return nil
		}),
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "print",
		Short: "Print the migrations' SQL, for teams that apply migrations with their own tool",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return schema.Print(os.Stdout)
		},
	})
	return cmd
}
