package main

import (
	"fmt"

	"github.com/fanout/fanout/deploy"
	"github.com/spf13/cobra"
)

func natsHashesCommand() *cobra.Command {
	var from, to string
	cmd := &cobra.Command{
		Use:   "nats-hashes --from DIR --to DIR",
		Short: "Write the bcrypt hash of each NATS password file (nats_<user>_password) of --from into --to, for the NATS server",
		Long: `The NATS server needs only the hashes of its users' passwords: compose.yaml's
nats-hashes job runs this, and the server's container mounts the hashes
(nats_<user>_password.bcrypt), never a password. A hash that still matches
its password is kept; a changed password's hash is written again.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			written, err := deploy.HashNATSPasswords(from, to)
			for _, name := range written {
				fmt.Fprintln(cmd.OutOrStdout(), "wrote", name)
			}
			if err == nil && len(written) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "every hash matches its password")
			}
			return err
		},
	}
	cmd.Flags().StringVar(&from, "from", "/run/secrets", "the directory of the password files")
	cmd.Flags().StringVar(&to, "to", "/nats-hashes", "the directory the hashes are written to")
	return cmd
}
