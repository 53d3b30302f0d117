package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

// Status is what `fanout status` reports.
type Status struct {
	Outbox struct {
		Pending          int64   `json:"pending"`
		Sending          int64   `json:"sending"`
		Sent             int64   `json:"sent"`
		Failed           int64   `json:"failed"`
		OldestPendingAge float64 `json:"oldest_pending_age_seconds"`
	} `json:"outbox"`
	Stream struct {
		Name     string `json:"name"`
		Messages uint64 `json:"messages"`
		Bytes    uint64 `json:"bytes"`
		FirstSeq uint64 `json:"first_seq"`
		LastSeq  uint64 `json:"last_seq"`
		// Missing: the stream does not exist yet (the relay creates it).
		Missing bool `json:"missing,omitempty"`
	} `json:"stream"`
	Subscribers []SubscriberStatus `json:"subscribers"`
}

// SubscriberStatus is one subscriber's state.
type SubscriberStatus struct {
	Name         string `json:"name"`
	Pending      uint64 `json:"pending"`
	AckPending   int    `json:"ack_pending"`
	Redelivered  int    `json:"redelivered"`
	Checkpoint   int64  `json:"checkpoint_rows"`
	DeadLetters  uint64 `json:"dead_letters"`
	ConsumerGone bool   `json:"consumer_missing,omitempty"`
}

func statusCommand(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Outbox backlog, stream size, and each subscriber's lag, checkpoint and dead letters",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.load(); err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			pool, err := a.postgres(ctx, "status")
			if err != nil {
				return err
			}
			defer pool.Close()
			nc, err := a.nats("status")
			if err != nil {
				return err
			}
			defer nc.Close()
			js, err := jetstream.New(nc)
			if err != nil {
				return err
			}
			var st Status
			store := outbox.NewStore(pool)
			backlog, err := store.Backlog(ctx)
			if err != nil {
				return fmt.Errorf("outbox: %w", err)
			}
			sent, err := store.CountSent(ctx)
			if err != nil {
				return fmt.Errorf("outbox: %w", err)
			}
			st.Outbox.Pending, st.Outbox.Sending, st.Outbox.Sent, st.Outbox.Failed = backlog.Pending, backlog.Sending, sent, backlog.Failed
			st.Outbox.OldestPendingAge = backlog.OldestPending.Seconds()
			// A stream not created yet (a fresh installation, the relay not
			// started) is a state to report, not an error.
			st.Stream.Name = a.cfg.Stream.Name
			stream, err := js.Stream(ctx, a.cfg.Stream.Name)
			switch {
			case errors.Is(err, jetstream.ErrStreamNotFound):
				st.Stream.Missing = true
			case err != nil:
				return fmt.Errorf("stream %s: %w", a.cfg.Stream.Name, err)
			default:
				info := stream.CachedInfo()
				st.Stream.Messages, st.Stream.Bytes = info.State.Msgs, info.State.Bytes
				st.Stream.FirstSeq, st.Stream.LastSeq = info.State.FirstSeq, info.State.LastSeq
			}

			checkpoints, err := subscribers.CountCheckpoints(ctx, pool)
			if err != nil {
				return err
			}
			dead, err := deadLetterCounts(ctx, js, pool, a.cfg.Subscribers.DeadLetterStream, a.cfg.Subscribers.DeadLetterSubjectPrefix)
			if err != nil {
				return err
			}
			// Every subscriber this binary knows, and any other the stream,
			// the checkpoints or the dead letters name.
			names := map[string]bool{}
			for _, n := range subscriberNames() {
				names[n] = true
			}
			for n := range checkpoints {
				names[n] = true
			}
			for n := range dead {
				names[n] = true
			}
			consumers := map[string]*jetstream.ConsumerInfo{}
			if stream != nil {
				lister := stream.ListConsumers(ctx)
				for ci := range lister.Info() {
					consumers[ci.Name] = ci
					names[ci.Name] = true
				}
				if err := lister.Err(); err != nil {
					return err
				}
			}
			for n := range names {
				s := SubscriberStatus{Name: n, Checkpoint: checkpoints[n], DeadLetters: dead[n]}
				if ci, ok := consumers[n]; ok {
					s.Pending, s.AckPending, s.Redelivered = ci.NumPending, ci.NumAckPending, ci.NumRedelivered
				} else {
					s.ConsumerGone = true
				}
				st.Subscribers = append(st.Subscribers, s)
			}
			slices.SortFunc(st.Subscribers, func(x, y SubscriberStatus) int { return strings.Compare(x.Name, y.Name) })
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(st)
			}
			printStatus(cmd.OutOrStdout(), st)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON for scripts")
	return cmd
}

// deadLetterCounts counts the dead letters to resolve per subscriber: the
// stream's per-subject state (deadletter.<subscriber>.<event_type>) less
// the letters still in it that operators resolved (dead_letter_actions).
func deadLetterCounts(ctx context.Context, js jetstream.JetStream, pool *pgxpool.Pool, streamName, prefix string) (map[string]uint64, error) {
	out := map[string]uint64{}
	s, err := js.Stream(ctx, streamName)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(prefix+".>"))
	if err != nil {
		return nil, err
	}
	for subject, n := range info.State.Subjects {
		parts := strings.SplitN(subject, ".", 3)
		if len(parts) >= 2 {
			out[parts[1]] += n
		}
	}
	resolved, err := resolutions(ctx, pool)
	if err != nil {
		return nil, err
	}
	for k := range resolved {
		if k.seq >= info.State.FirstSeq && out[k.subscriber] > 0 {
			out[k.subscriber]--
		}
	}
	return out, nil
}

func printStatus(w io.Writer, st Status) {
	o := st.Outbox
	fmt.Fprintf(w, "outbox   pending %d  sending %d  sent %d (retained)  failed %d  oldest pending %s\n",
		o.Pending, o.Sending, o.Sent, o.Failed, (time.Duration(o.OldestPendingAge * float64(time.Second))).Round(time.Millisecond))
	if st.Stream.Missing {
		fmt.Fprintf(w, "stream   %s  not created yet (the relay creates it at start unless stream.provision is verify or off)\n\n", st.Stream.Name)
	} else {
		fmt.Fprintf(w, "stream   %s  %d messages  %d bytes  seq %d..%d\n\n", st.Stream.Name, st.Stream.Messages, st.Stream.Bytes, st.Stream.FirstSeq, st.Stream.LastSeq)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SUBSCRIBER\tPENDING\tACK PENDING\tREDELIVERED\tCHECKPOINT\tDEAD LETTERS")
	for _, s := range st.Subscribers {
		pending := fmt.Sprint(s.Pending)
		if s.ConsumerGone {
			pending = "(no consumer)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\n", s.Name, pending, s.AckPending, s.Redelivered, s.Checkpoint, s.DeadLetters)
	}
	tw.Flush()
}
