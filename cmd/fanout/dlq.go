package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

// dlqEnv is what the dead-letter commands work with.
type dlqEnv struct {
	a      *app
	pool   *pgxpool.Pool
	nc     *nats.Conn
	stream jetstream.Stream
}

func openDLQ(ctx context.Context, a *app) (*dlqEnv, error) {
	if err := a.load(); err != nil {
		return nil, err
	}
	pool, err := a.postgres(ctx, "dlq")
	if err != nil {
		return nil, err
	}
	nc, err := a.nats("dlq")
	if err != nil {
		pool.Close()
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err == nil {
		var s jetstream.Stream
		if s, err = js.Stream(ctx, a.cfg.Subscribers.DeadLetterStream); err == nil {
			return &dlqEnv{a: a, pool: pool, nc: nc, stream: s}, nil
		}
	}
	nc.Close()
	pool.Close()
	return nil, fmt.Errorf("dead-letter stream %s: %w", a.cfg.Subscribers.DeadLetterStream, err)
}

func (e *dlqEnv) close() {
	e.nc.Close()
	e.pool.Close()
}

// deadLetter is one message of the dead-letter stream, as listed.
type deadLetter struct {
	Seq        uint64
	Subscriber string // from the subject it is stored under
	EventID    string
	EventType  string
	Reason     string
	Deliveries string
	At         string
	// Refused says why no command acts on this letter (it disagrees with
	// itself: see subscribers.ParseDeadLetter), or is empty.
	Refused string
	// Resolved says how an operator resolved it (redriven, discarded), or
	// is empty: the stream keeps resolved letters until they age out.
	Resolved string
	parsed   subscribers.DeadLetter
	raw      *jetstream.RawStreamMsg
}

// resolvedSQL finds the letters an operator resolved: discarded, or
// redriven with the event handled (or found already handled). The stream
// denies deletes, so a resolved letter stays until it ages out; this is
// what tells it apart.
const resolvedSQL = `
SELECT DISTINCT ON (stream_seq, subscriber) stream_seq, subscriber, action || ' by ' || actor || ' at ' || to_char(at, 'YYYY-MM-DD"T"HH24:MI:SSOF')
FROM dead_letter_actions
WHERE action = 'discard' OR (action = 'redrive' AND outcome IN ('handled', 'already in the checkpoint'))
ORDER BY stream_seq, subscriber, at DESC`

// resolutions returns how each resolved letter was resolved, by sequence
// and subscriber.
func resolutions(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) (map[resolvedKey]string, error) {
	rows, err := q.Query(ctx, resolvedSQL)
	if err != nil {
		return nil, fmt.Errorf("read dead_letter_actions: %w", err)
	}
	out := map[resolvedKey]string{}
	var seq int64
	var subscriber, how string
	_, err = pgx.ForEachRow(rows, []any{&seq, &subscriber, &how}, func() error {
		out[resolvedKey{uint64(seq), subscriber}] = how
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read dead_letter_actions: %w", err)
	}
	return out, nil
}

type resolvedKey struct {
	seq        uint64
	subscriber string
}

// list returns the dead letters, of one subscriber if not empty, with how
// each was resolved, if it was.
func (e *dlqEnv) list(ctx context.Context, subscriber string) ([]deadLetter, error) {
	resolved, err := resolutions(ctx, e.pool)
	if err != nil {
		return nil, err
	}
	filter := e.a.cfg.Subscribers.DeadLetterSubjectPrefix + ".>"
	if subscriber != "" {
		filter = e.a.cfg.Subscribers.DeadLetterSubjectPrefix + "." + subscriber + ".>"
	}
	info, err := e.stream.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []deadLetter
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; {
		m, err := e.stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(filter))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			return nil, err
		}
		d := e.describe(m)
		d.Resolved = resolved[resolvedKey{d.Seq, d.Subscriber}]
		out = append(out, d)
		seq = m.Sequence + 1
	}
	return out, nil
}

// unresolved keeps the letters no operator has resolved yet.
func unresolved(ds []deadLetter) []deadLetter {
	var out []deadLetter
	for _, d := range ds {
		if d.Resolved == "" {
			out = append(out, d)
		}
	}
	return out
}

func (e *dlqEnv) describe(m *jetstream.RawStreamMsg) deadLetter {
	p, err := subscribers.ParseDeadLetter(m, e.a.cfg.Subscribers, e.a.cfg.Stream)
	d := deadLetter{Seq: m.Sequence, Subscriber: p.Subscriber, EventID: m.Header.Get(outbox.EventIDHeader),
		EventType: m.Header.Get(outbox.EventTypeHeader), Reason: p.Reason, Deliveries: p.Deliveries, At: p.At, parsed: p, raw: m}
	if err != nil {
		d.Refused = err.Error()
	}
	return d
}

// targets resolves `<seq>` or `--subscriber S` into dead letters.
func (e *dlqEnv) targets(ctx context.Context, args []string, subscriber string) ([]deadLetter, error) {
	if (len(args) == 1) == (subscriber != "") {
		return nil, errors.New("give either a dead letter's sequence number or --subscriber")
	}
	if subscriber != "" {
		ds, err := e.list(ctx, subscriber)
		return unresolved(ds), err
	}
	seq, err := strconv.ParseUint(args[0], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%q is not a sequence number (see `fanout dlq list`)", args[0])
	}
	m, err := e.stream.GetMsg(ctx, seq)
	if err != nil {
		return nil, fmt.Errorf("dead letter %d: %w", seq, err)
	}
	resolved, err := resolutions(ctx, e.pool)
	if err != nil {
		return nil, err
	}
	d := e.describe(m)
	d.Resolved = resolved[resolvedKey{d.Seq, d.Subscriber}]
	return []deadLetter{d}, nil
}

// eventOf returns the event a redrive hands to the letter's subscriber: the
// copy in the events stream, after checking that the letter agrees with it
// and with itself (a letter is written by its subscriber's own process, and
// a redrive writes that subscriber's checkpoint: a forged letter must not
// make it skip a real event). fromLetter trusts the letter's own copy of an
// event the stream no longer holds.
func (e *dlqEnv) eventOf(ctx context.Context, dl deadLetter, fromLetter bool) (subscribers.Event, error) {
	if dl.Refused != "" {
		return subscribers.Event{}, errors.New(dl.Refused)
	}
	p := dl.parsed
	js, err := jetstream.New(e.nc)
	if err != nil {
		return subscribers.Event{}, err
	}
	err = p.Verify(ctx, js, e.a.cfg.Stream)
	switch {
	case err == nil:
		return p.Event, nil
	case errors.Is(err, jetstream.ErrMsgNotFound) && fromLetter:
		if omitted := dl.raw.Header.Get(subscribers.DeadBodyOmittedHeader); omitted != "" {
			return subscribers.Event{}, fmt.Errorf("the dead letter was stored without the event's body (%s bytes) and the stream no longer holds the event", omitted)
		}
		return p.Event, nil
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return subscribers.Event{}, fmt.Errorf("%w; the events stream no longer holds the event: redrive with --from-letter to trust the dead letter's own copy", err)
	}
	return subscribers.Event{}, err
}

// record notes an operator's action on a dead letter.
func (e *dlqEnv) record(ctx context.Context, action string, d deadLetter, outcome, actor string) error {
	id, _ := strconv.ParseInt(d.EventID, 10, 64)
	_, err := e.pool.Exec(ctx, `
INSERT INTO dead_letter_actions (action, subscriber, event_id, stream_seq, outcome, actor)
VALUES ($1, $2, nullif($3, 0), $4, $5, $6)`, action, d.Subscriber, id, int64(d.Seq), outcome, actor)
	return err
}

func defaultActor() string {
	name := "unknown"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return name + "@" + host
}

func dlqCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List, show, redrive or discard dead letters",
	}
	var subscriber, actor string
	var fromLetter, all bool
	list := &cobra.Command{
		Use:   "list",
		Short: "List dead letters (of one subscriber with --subscriber)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.list(ctx, subscriber)
			if err != nil {
				return err
			}
			shown := ds
			if !all {
				shown = unresolved(ds)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "SEQ\tSUBSCRIBER\tEVENT\tTYPE\tDELIVERIES\tDEAD AT\tREASON")
			for _, d := range shown {
				reason := truncate(d.Reason, 100)
				switch {
				case d.Refused != "":
					reason = "REFUSED (" + truncate(d.Refused, 160) + ")"
				case d.Resolved != "":
					reason = "RESOLVED: " + d.Resolved + " (" + truncate(d.Reason, 60) + ")"
				}
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", d.Seq, d.Subscriber, d.EventID, d.EventType, d.Deliveries, d.At, reason)
			}
			tw.Flush()
			fmt.Fprintf(cmd.OutOrStdout(), "%d dead letters to resolve (%d resolved, kept until they age out: --all lists them)\n", len(unresolved(ds)), len(ds)-len(unresolved(ds)))
			return nil
		},
	}
	list.Flags().StringVar(&subscriber, "subscriber", "", "only this subscriber's dead letters")
	list.Flags().BoolVar(&all, "all", false, "also the letters already resolved")

	show := &cobra.Command{
		Use:   "show <seq>",
		Short: "Show a dead letter: its headers (subscriber, reason, deliveries, original subject) and body",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.targets(ctx, args, "")
			if err != nil {
				return err
			}
			m := ds[0].raw
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "seq %d, subject %s, stored %s\n", m.Sequence, m.Subject, m.Time.UTC().Format(time.RFC3339))
			for k, vs := range m.Header {
				fmt.Fprintf(w, "%s: %s\n", k, strings.Join(vs, ", "))
			}
			fmt.Fprintf(w, "\n%s\n", m.Data)
			return nil
		},
	}

	redrive := &cobra.Command{
		Use:   "redrive <seq> | --subscriber S",
		Short: "Hand dead letters back to their subscriber only: run its handler once more; on success the letter is resolved",
		Long: `redrive runs the dead letter's own subscriber's handler on the event, in this
process, with the subscriber's checkpoint (an event it already handled is not
handled twice). No other subscriber sees the event again. On success the
letter is resolved (the dead-letter stream denies deletes: it stays, marked
resolved, until it ages out); on failure it stays to be resolved, and the
error is printed. Every attempt is recorded in the dead_letter_actions table
with --actor.

The subscriber is the one whose name the letter is stored under (a
subscriber may publish dead letters under its own name only); a letter whose
headers name another is refused. The event handed to the handler is the one
in the events stream at the sequence the letter names, checked to be the
same event and one the subscriber receives: a forged letter cannot make a
subscriber checkpoint, and so skip, an event it never handled. For an event
the stream no longer holds, --from-letter trusts the letter's own copy.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.targets(ctx, args, subscriber)
			if err != nil {
				return err
			}
			d := &deps{a: a, ctx: ctx, pool: e.pool, reg: nil}
			defer d.close()
			runners := map[string]*subscribers.Runner{}
			// runnerOf builds the subscriber's handler, in this process,
			// the first time one of its letters is redriven.
			runnerOf := func(name string) (*subscribers.Runner, error) {
				if r, ok := runners[name]; ok {
					return r, nil
				}
				decl, err := subscriberRegistry.Lookup(name)
				if err != nil {
					return nil, fmt.Errorf("dead letters of %q: this binary knows no such subscriber", name)
				}
				h, err := d.build(decl)
				if err != nil {
					return nil, err
				}
				r, err := subscribers.New(subscribers.Options{Handler: h, Config: a.cfg.Subscriber(name), Stream: a.cfg.Stream,
					Pool: e.pool, Conn: e.nc, Logger: logging.Component(a.logger, "dlq")})
				if err != nil {
					return nil, err
				}
				runners[name] = r
				return r, nil
			}
			failed := 0
			for _, dl := range ds {
				if dl.Resolved != "" {
					fmt.Fprintf(cmd.OutOrStdout(), "%d (%s, event %s): already resolved: %s\n", dl.Seq, dl.Subscriber, dl.EventID, dl.Resolved)
					continue
				}
				outcome := "handled"
				ev, err := e.eventOf(ctx, dl, fromLetter)
				if err == nil {
					var r *subscribers.Runner
					if r, err = runnerOf(dl.Subscriber); err != nil {
						return err
					}
					var handled bool
					if handled, err = r.HandleOnce(ctx, ev); err == nil && !handled {
						outcome = "already in the checkpoint"
					}
				}
				if err != nil {
					outcome = "failed: " + err.Error()
					failed++
				}
				if rerr := e.record(ctx, "redrive", dl, outcome, actor); rerr != nil {
					return fmt.Errorf("record redrive of %d: %w", dl.Seq, rerr)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%d (%s, event %s): %s\n", dl.Seq, dl.Subscriber, dl.EventID, outcome)
			}
			if failed > 0 {
				return fmt.Errorf("%d of %d redrives failed; their dead letters remain to be resolved", failed, len(ds))
			}
			return nil
		},
	}
	redrive.Flags().StringVar(&subscriber, "subscriber", "", "redrive every dead letter of this subscriber")
	redrive.Flags().BoolVar(&fromLetter, "from-letter", false, "for an event the events stream no longer holds (past stream.max_age): trust the dead letter's own copy")
	redrive.Flags().StringVar(&actor, "actor", defaultActor(), "who is redriving (recorded)")

	discard := &cobra.Command{
		Use:   "discard <seq> | --subscriber S",
		Short: "Resolve dead letters without handling them (recorded in dead_letter_actions; the letters stay until they age out)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			e, err := openDLQ(ctx, a)
			if err != nil {
				return err
			}
			defer e.close()
			ds, err := e.targets(ctx, args, subscriber)
			if err != nil {
				return err
			}
			for _, dl := range ds {
				if dl.Refused != "" {
					return fmt.Errorf("discard %d: %s", dl.Seq, dl.Refused)
				}
				if dl.Resolved != "" {
					continue
				}
				if err := e.record(ctx, "discard", dl, "discarded", actor); err != nil {
					return err
				}
			}
			fmt.Fprintf(cmd.OutOrStdout(), "discarded %d dead letters\n", len(unresolved(ds)))
			return nil
		},
	}
	discard.Flags().StringVar(&subscriber, "subscriber", "", "discard every dead letter of this subscriber")
	discard.Flags().StringVar(&actor, "actor", defaultActor(), "who is discarding (recorded)")

	cmd.AddCommand(list, show, redrive, discard)
	return cmd
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
