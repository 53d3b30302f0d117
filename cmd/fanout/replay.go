package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

func replayCommand(a *app) *cobra.Command {
	var fromTime, reason string
	var fromSeq uint64
	cmd := &cobra.Command{
		Use:   "replay <subscriber> --from-time T | --from-seq N",
		Short: "Move one subscriber's consumer back, so it receives the stream's history again from T or N",
		Long: `replay resets one subscriber's durable consumer to a stream position; its
running instances receive the events from there on again. Other subscribers
are not touched. The subscriber's checkpoint makes this safe: events it already
handled are acked and skipped, so a replay fills gaps (events lost or skipped)
without doing anything twice. The consumer must have been created with
subscribers.start = all or time (the default is all).

Every replay is recorded in the replays table, before it is made and with
its outcome, with the database role that ran it and --reason (a reset can
also move a consumer forward, past events the subscriber then never
receives: the record says who did). A reset sent with the operator's NATS
credential by other means than this command is not recorded: NATS keeps no
trail of API calls.`,
		Args: cobra.ExactArgs(1),
		RunE: a.loaded(func(cmd *cobra.Command, args []string) error {
			if (fromTime == "") == (fromSeq == 0) {
				return errors.New("give exactly one of --from-time and --from-seq")
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
			if err := recordedReset(ctx, c.pool, js, a.cfg.Stream.Name, name, seq, reason); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "subscriber %s will receive stream %s again from sequence %d; its checkpoint skips what it already handled\n", name, a.cfg.Stream.Name, seq)
			return nil
		}),
	}
	cmd.Flags().StringVar(&fromTime, "from-time", "", "RFC 3339 time, or a duration ago (e.g. 2h)")
	cmd.Flags().Uint64Var(&fromSeq, "from-seq", 0, "stream sequence number")
	cmd.Flags().StringVar(&reason, "reason", "", "why (recorded in the replays table beside the database role that acts)")
	return cmd
}

// recordedReset moves subscriber name's consumer to seq, recorded in the
// replays table before it is done (no unrecorded move), and again with
// what came of it.
func recordedReset(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, streamName, name string, seq uint64, reason string) error {
	record := func(outcome string) error {
		_, err := pool.Exec(ctx, `SELECT fanout_record_replay($1, $2, $3, $4, $5)`, name, streamName, int64(seq), outcome, reason)
		if err != nil {
			return fmt.Errorf("subscriber %s: the replay from sequence %d (%s) could not be recorded in the replays table: %w", name, seq, outcome, err)
		}
		return nil
	}
	if err := record("requested"); err != nil {
		return err
	}
	_, err := js.ResetConsumerToSequence(ctx, streamName, name, seq)
	outcome := "moved"
	if err != nil {
		outcome = "failed: " + err.Error()
	}
	if rerr := record(outcome); rerr != nil {
		return rerr
	}
	if errors.Is(err, jetstream.ErrConsumerInvalidReset) {
		return fmt.Errorf("subscriber %s: its consumer's start position does not allow sequence %d (was it created with subscribers.start=new?): %w", name, seq, err)
	}
	return err
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
