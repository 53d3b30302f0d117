package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

func replayCommand(a *app) *cobra.Command {
	var fromTime, reason string
	var fromSeq uint64
	var wait time.Duration
	cmd := &cobra.Command{
		Use:   "replay <subscriber> --from-time T | --from-seq N",
		Short: "Move one subscriber's consumer back, so it receives the stream's history again from T or N",
		Long: `replay moves one subscriber's durable consumer to a stream position; its
running instances receive the events from there on again. Other subscribers
are not touched. The subscriber's checkpoint makes this safe: events it already
handled are acked and skipped, so a replay fills gaps (events lost or skipped)
without doing anything twice. The consumer must have been created with
subscribers.start = all or time (the default is all).

The operator cannot move a consumer itself: replay records a request in the
replays table, with the database role that ran it and --reason, and a
running instance of the subscriber (the only role that may reset its own
consumer) takes it within a second or so, moves its consumer and records
the outcome. replay waits for that outcome. A request no instance takes
within --wait lapses: no instance takes it later. A replay moves a consumer
back only: a position past the consumer's ack floor (events it has not
acknowledged would be skipped) is refused.`,
		Args: cobra.ExactArgs(1),
		RunE: a.loaded(func(cmd *cobra.Command, args []string) error {
			if (fromTime == "") == (fromSeq == 0) {
				return errors.New("give exactly one of --from-time and --from-seq")
			}
			if wait <= 0 || wait > 24*time.Hour {
				return fmt.Errorf("--wait %s: must be more than 0 and at most 24h", wait)
			}
			ctx := cmd.Context()
			c, err := a.open(ctx, "replay", withNATS)
			if err != nil {
				return err
			}
			defer c.close()
			name, js := args[0], c.js
			if _, err := js.Consumer(ctx, a.cfg.Stream.Name, name); err != nil {
				return fmt.Errorf("subscriber %s: %w", name, err)
			}
			seq := fromSeq
			if fromTime != "" {
				t, err := parseSince(fromTime)
				if err != nil {
					return err
				}
				seq, err = firstSeqAtOrAfter(ctx, js, a.cfg.Stream.Name, t)
				if err != nil {
					return err
				}
			}
			r := bookkeeping.ReplayRequest{Subscriber: name, Stream: a.cfg.Stream.Name, FromSeq: seq, Within: wait, Reason: reason}
			by, err := requestReplay(ctx, bookkeeping.NewReplays(c.pool), r)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "subscriber %s will receive stream %s again from sequence %d; its checkpoint skips what it already handled (moved by its instance, as role %s)\n", name, a.cfg.Stream.Name, seq, by)
			return nil
		}),
	}
	cmd.Flags().StringVar(&fromTime, "from-time", "", "RFC 3339 time, or a duration ago (e.g. 2h)")
	cmd.Flags().Uint64Var(&fromSeq, "from-seq", 0, "stream sequence number")
	cmd.Flags().StringVar(&reason, "reason", "", "why (recorded in the replays table beside the database role that acts)")
	cmd.Flags().DurationVar(&wait, "wait", time.Minute, "how long a running instance of the subscriber has to take the request before it lapses")
	return cmd
}

// requestReplay records r and waits for the subscriber to carry it out;
// it returns the role that moved the consumer, or why nothing moved.
func requestReplay(ctx context.Context, rs bookkeeping.Replays, r bookkeeping.ReplayRequest) (string, error) {
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	id, err := rs.Request(rctx, r)
	cancel()
	if err != nil {
		return "", fmt.Errorf("subscriber %s: record the replay request: %w", r.Subscriber, err)
	}
	for {
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("subscriber %s: replay request %d: stopped waiting for its outcome (it lapses on its own): %w", r.Subscriber, id, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
		// Outcome waits for an instance holding the request, which holds
		// it for replayTimeout (15 s) at most.
		octx, cancel := context.WithTimeout(ctx, 30*time.Second)
		o, err := rs.Outcome(octx, id)
		cancel()
		switch {
		case err != nil:
			return "", fmt.Errorf("subscriber %s: replay request %d: read its outcome: %w", r.Subscriber, id, err)
		case o.Outcome == bookkeeping.ReplayRequested:
			continue
		case o.Outcome == bookkeeping.ReplayMoved:
			return o.Actor, nil
		case o.Outcome == bookkeeping.ReplayLapsed:
			return "", fmt.Errorf("subscriber %s: replay request %d lapsed after %s with no outcome recorded: no running instance took it (start the subscriber and replay again), or one failed while carrying it out (its log says so, and its consumer may have moved)", r.Subscriber, id, r.Within)
		default:
			return "", fmt.Errorf("subscriber %s: replay request %d %s (recorded by %s)", r.Subscriber, id, o.Outcome, o.Actor)
		}
	}
}

// firstSeqAtOrAfter is the stream sequence of the first message stored at or
// after t. It asks the stream by time (a message get with start_time), so
// the operator needs no consumer of its own to find a position.
func firstSeqAtOrAfter(ctx context.Context, js jetstream.JetStream, streamName string, t time.Time) (uint64, error) {
	req, err := json.Marshal(struct {
		StartTime time.Time `json:"start_time"`
	}{t.UTC()})
	if err != nil {
		return 0, err
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	m, err := js.Conn().RequestWithContext(rctx, "$JS.API.STREAM.MSG.GET."+streamName, req)
	if err != nil {
		return 0, fmt.Errorf("stream %s: message at %s: %w", streamName, t.UTC().Format(time.RFC3339), err)
	}
	var resp struct {
		Error *struct {
			Code        int    `json:"code"`
			Description string `json:"description"`
		} `json:"error"`
		Message *struct {
			Seq uint64 `json:"seq"`
		} `json:"message"`
	}
	if err := json.Unmarshal(m.Data, &resp); err != nil {
		return 0, fmt.Errorf("stream %s: message at %s: %w", streamName, t.UTC().Format(time.RFC3339), err)
	}
	if resp.Error != nil || resp.Message == nil {
		why := "no answer"
		if resp.Error != nil {
			why = resp.Error.Description
		}
		return 0, fmt.Errorf("no event in stream %s at or after %s: %s", streamName, t.UTC().Format(time.RFC3339), why)
	}
	return resp.Message.Seq, nil
}
