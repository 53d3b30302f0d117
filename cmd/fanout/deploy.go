package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/fanout/fanout/deploy"
	"github.com/spf13/cobra"
)

func deployCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "deploy",
		Short: "Write the deployment files (NATS users, Postgres roles, compose services, secrets) derived from the subscribers' declarations",
		Long: `Every subscriber in the registry (subscribers/registry) gets a NATS user
with the permissions of its consumer only, a Postgres role with its
declared grants and row-level policies on its own checkpoints, a compose
service, and its secrets. The files in deploy/ are this command's output:

  go run ./cmd/fanout deploy render deploy

after adding a subscriber or changing a declaration; a test fails while
they differ. Each file can also be printed on its own.`,
	}
	var check bool
	render := &cobra.Command{
		Use:   "render [DIR]",
		Short: "Write every deployment file under DIR (default deploy), or with --check report the ones that differ",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir := "deploy"
			if len(args) == 1 {
				dir = args[0]
			}
			decls := subscriberRegistry.All()
			if check {
				var stale []string
				for _, f := range deploy.Files {
					want, err := f.Render(decls)
					if err != nil {
						return err
					}
					path := filepath.Join(dir, f.Path)
					if have, err := os.ReadFile(path); err != nil || !bytes.Equal(have, want) {
						stale = append(stale, path)
					}
				}
				if len(stale) > 0 {
					for _, p := range stale {
						fmt.Fprintln(cmd.OutOrStdout(), "differs:", p)
					}
					return errors.New("deployment files differ from the subscribers' declarations: run `go run ./cmd/fanout deploy render " + dir + "`")
				}
				fmt.Fprintln(cmd.OutOrStdout(), "deployment files up to date")
				return nil
			}
			changed, err := deploy.RenderAll(dir, decls)
			for _, p := range changed {
				fmt.Fprintln(cmd.OutOrStdout(), "wrote", p)
			}
			if err == nil && len(changed) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "deployment files up to date")
			}
			return err
		},
	}
	render.Flags().BoolVar(&check, "check", false, "write nothing; fail if a file differs")
	cmd.AddCommand(render)
	cmd.AddCommand(natsHashesCommand())
	for _, f := range deploy.Files {
		cmd.AddCommand(&cobra.Command{
			Use:   f.Name,
			Short: "Print " + f.Path,
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				out, err := f.Render(subscriberRegistry.All())
				if err != nil {
					return err
				}
				_, err = cmd.OutOrStdout().Write(out)
				return err
			},
		})
	}
	return cmd
}
