// Command fanout runs every role of the outbox pipeline; the subcommand picks
// the role (one binary, one container image). `fanout --help` lists them.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := rootCommand().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "fanout:", err)
		os.Exit(1)
	}
}

func rootCommand() *cobra.Command {
	var configPath string
	root := &cobra.Command{
		Use:   "fanout",
		Short: "Deliver every committed Postgres outbox event to every interested subscriber",
		Long: `fanout moves events that writers commit to the Postgres outbox table onto
NATS JetStream (the relay), and from there to independent subscribers.

Configuration: built-in defaults, then the YAML file given by --config (or
FANOUT_CONFIG), then FANOUT_* environment variables (relay.batch_size is
FANOUT_RELAY_BATCH_SIZE). ` + "`fanout config keys`" + ` lists every key.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&configPath, "config", os.Getenv("FANOUT_CONFIG"), "YAML config file (default $FANOUT_CONFIG)")
	app := &app{configPath: &configPath}
	root.PersistentPostRun = func(*cobra.Command, []string) { app.close() }
	root.AddCommand(
		migrateCommand(app),
		provisionCommand(app),
		relayCommand(app),
		subscribeCommand(app),
		reindexCommand(app),
		backfillCommand(app),
		demoCommand(app),
		upCommand(app),
		configCommand(app),
		healthcheckCommand(app),
		statusCommand(app),
		dlqCommand(app),
		outboxCommand(app),
		auditCommand(app),
		replayCommand(app),
		eventsCommand(app),
		deployCommand(),
	)
	return root
}
