package main

import (
	"fmt"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/fanout/fanout/deploy"
	"github.com/fanout/fanout/events"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/spf13/cobra"
)

// eventsCommand shows the declared event types (shop/eventtypes): what a
// team consuming them, in any language, needs to know.
func eventsCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "events",
		Short: "The declared event types: their subjects, schemas and readers",
		Long: `events shows the declared event types (shop/eventtypes, one JSON Schema of
draft 2020-12 a type). The shop's writers refuse an event whose payload breaks
its type's schema, or whose type is not declared; the relay marks such a row
written some other way failed, with the reason (relay.undeclared_events says
what it does with an undeclared type: publish, the default, or fail).`,
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(eventsListCommand(a), eventsSchemaCommand(), eventsCheckCommand(), eventsAsyncAPICommand(a))
	return cmd
}

func eventsListCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "list",
		Short: "Print every declared event type: subject, schema version, aggregate, and which subscribers read it (* when in order)",
		Args:  cobra.NoArgs,
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "EVENT TYPE\tSUBJECT\tVERSION\tAGGREGATE\tREAD BY\tDESCRIPTION")
			for _, t := range shop.EventTypes.Types() {
				subject := stream.Subject(a.cfg.Stream.SubjectPrefix, t.Name)
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", t.Name, subject, t.Version, t.AggregateType, readers(t.Name), t.Description)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), "\n* reads the type's events of one aggregate in order")
			return nil
		}),
	}
}

// readers names the subscribers whose filters take eventType, an ordered
// one marked with a *.
func readers(eventType string) string {
	var names []string
	for _, d := range subscriberRegistry.All() {
		if !d.Reads(eventType) {
			continue
		}
		if d.Ordered {
			names = append(names, d.Name+"*")
		} else {
			names = append(names, d.Name)
		}
	}
	if len(names) == 0 {
		return "-"
	}
	return strings.Join(names, ",")
}

func eventsSchemaCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "schema EVENT_TYPE",
		Short: "Print an event type's declaration: its JSON Schema",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			t := shop.EventTypes.Lookup(args[0])
			if t == nil {
				var names []string
				for _, t := range shop.EventTypes.Types() {
					names = append(names, t.Name)
				}
				return fmt.Errorf("event type %q is not declared (declared: %s)", args[0], strings.Join(names, ", "))
			}
			_, err := cmd.OutOrStdout().Write(t.Schema)
			return err
		},
	}
}

func eventsCheckCommand() *cobra.Command {
	var releasedDir string
	cmd := &cobra.Command{
		Use:   "check [--released DIR]",
		Short: "Check that the declarations keep every promise of the released ones (no property removed, retyped or newly required)",
		Long: `check compares each declared event type with its declaration as last released
(shop/eventtypes/released, built in; --released reads another directory of
declarations, such as a checkout of the last release's shop/eventtypes). A
property added and optional passes; a property removed or retyped, a rule
changed, a property newly required, properties closed, a type no longer
declared, or a schema changed without a higher x-fanout-version is reported,
and the command fails. A change readers of a type cannot take is a new type,
with its own subject.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			released, err := releasedEventTypes(releasedDir)
			if err != nil {
				return err
			}
			problems := events.BreaksRelease(released, shop.EventTypes)
			for _, p := range problems {
				fmt.Fprintln(cmd.OutOrStdout(), p)
			}
			if len(problems) > 0 {
				return fmt.Errorf("%d changes break the released declarations", len(problems))
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d event types declared keep every promise of the %d released\n", len(shop.EventTypes.Types()), len(released.Types()))
			return nil
		},
	}
	cmd.Flags().StringVar(&releasedDir, "released", "", "directory of the released declarations (default: the copy built in)")
	return cmd
}

func releasedEventTypes(dir string) (*events.Catalog, error) {
	if dir == "" {
		return shop.ReleasedEventTypes()
	}
	return events.Load(os.DirFS(dir))
}

func eventsAsyncAPICommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "asyncapi",
		Short: "Print the AsyncAPI 3.0 document of the events: a channel a declared type, its headers and payload schema, who sends and receives it",
		Long: `asyncapi prints the AsyncAPI 3.0 document of the events, from the declared
event types and the subscriber registry, with the subjects under
stream.subject_prefix. deploy/asyncapi.yaml is its output with the defaults
(a test fails when it drifts):

  go run ./cmd/fanout events asyncapi > deploy/asyncapi.yaml`,
		Args: cobra.NoArgs,
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
			doc, err := deploy.AsyncAPI(shop.EventTypes, subscriberRegistry.All(), a.cfg.Stream.SubjectPrefix)
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(doc)
			return err
		}),
	}
}
