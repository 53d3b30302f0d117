package main

import (
	"fmt"

	"github.com/fanout/fanout/internal/config"
	"github.com/spf13/cobra"
	"gopkg.in/yaml.v3"
)

func configCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Inspect the configuration",
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "keys",
		Short: "List every configuration key with its environment variable",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			// Every key, then each subscriber's own settings, over the
			// shared ones.
			for _, k := range configKeys(subscriberNames()...) {
				fmt.Fprintf(cmd.OutOrStdout(), "%-40s %s\n", k, config.EnvName(k))
			}
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "print",
		Short: "Print the merged configuration (defaults, file, environment) as YAML, secrets redacted",
		Args:  cobra.NoArgs,
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
			out, err := yaml.Marshal(a.cfg.Redacted())
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(out)
			return err
		}),
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "check",
		Short: "Load and validate the configuration; exit non-zero naming every bad key",
		Args:  cobra.NoArgs,
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
			fmt.Fprintln(cmd.OutOrStdout(), "configuration is valid")
			return nil
		}),
	})
	return cmd
}
