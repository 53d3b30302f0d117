package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/metrics"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/spf13/cobra"
	"golang.org/x/term"
)

func backfillCommand(a *app) *cobra.Command {
	var (
		where                  string
		rate                   float64
		chunk, workers         int
		restart, pause, resume bool
	)
	cmd := &cobra.Command{
		Use:   "backfill <subscriber>",
		Short: "Hand a subscriber the current state of the table its declaration names, beside the live events",
		Long: `backfill reads the table the subscriber's declaration names (Declaration.Backfill)
in key order, in chunks, and hands each row to the subscriber's handler as the
event the declaration says (order.created for invoicing). The subscriber's live
events keep flowing meanwhile; its handler reads each row's state when it applies
it, so the two merge without regressions.

It resumes where it stopped (a chunk's effects commit with the backfill's
checkpoint), does nothing once finished (--restart runs it again), waits
through outages, and records a row the handler refuses in
subscriber_backfill_failures with the reason, going on with the rest. Progress
goes to stderr; ` + "`fanout status`" + ` shows a running backfill.

--where limits the rows (an SQL condition on the table, alias t, read-only);
--rate limits rows per second; --pause and --resume act on the backfill
running elsewhere; --restart starts over.`,
		Args: cobra.ExactArgs(1),
		RunE: a.loaded(func(cmd *cobra.Command, args []string) error {
			decl, err := subscriberRegistry.Lookup(args[0])
			if err != nil {
				return err
			}
			if decl.Backfill == nil {
				return fmt.Errorf("subscriber %s declares no backfill: its declaration names no table its state derives from", decl.Name)
			}
			if pause && resume {
				return errors.New("--pause and --resume: one at a time")
			}
			if rate < 0 {
				return fmt.Errorf("--rate %v: want rows per second, 0 for no limit", rate)
			}
			if chunk < 1 || chunk > 10000 {
				return fmt.Errorf("--chunk %d: want 1 to 10000 rows", chunk)
			}
			if workers < 1 || workers > 64 {
				return fmt.Errorf("--workers %d: want 1 to 64", workers)
			}
			ctx := cmd.Context()
			pool, err := a.postgres(ctx, "backfill")
			if err != nil {
				return err
			}
			defer pool.Close()
			if pause || resume {
				if err := backfill.Pause(ctx, pool, decl.Name, pause); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "backfill of %s %s\n", decl.Name, map[bool]string{true: "paused", false: "resumed"}[pause])
				return nil
			}
			reg := metrics.NewRegistry()
			d := &deps{a: a, ctx: ctx, pool: pool, reg: reg}
			defer d.close()
			h, err := d.build(decl)
			if err != nil {
				return err
			}
			stopOps, err := startOps(a, reg, nil)
			if err != nil {
				return err
			}
			defer stopOps()
			m := backfill.NewMetrics(reg)
			p := newBackfillProgress(cmd.ErrOrStderr())
			s, err := backfill.Run(ctx, backfill.Options{
				Declaration: decl, Handler: sabotagedBackfill(h), Config: a.cfg.Subscriber(decl.Name), Pool: pool,
				Logger: logging.Component(a.logger, "backfill"),
				Where:  where, Rate: rate, Chunk: chunk, Workers: workers, Restart: restart,
				Progress: func(s backfill.Status) { m.Observe(s); p.show(s) },
			})
			p.end(s)
			if err != nil {
				if ctx.Err() != nil {
					return fmt.Errorf("backfill of %s stopped (%d of %d rows done): run it again to resume", decl.Name, s.Done, s.Total)
				}
				return err
			}
			if s.Failed > 0 {
				return fmt.Errorf("backfill of %s: %d rows could not be applied; see subscriber_backfill_failures (fanout status names them)", decl.Name, s.Failed)
			}
			return nil
		}),
	}
	cmd.Flags().StringVar(&where, "where", "", "SQL condition on the table's rows (alias t), e.g. \"t.created_at < now() - interval '7 days'\"")
	cmd.Flags().Float64Var(&rate, "rate", 0, "at most this many rows per second (0: no limit)")
	cmd.Flags().IntVar(&chunk, "chunk", backfill.DefaultChunk, "rows per chunk (one transaction)")
	cmd.Flags().IntVar(&workers, "workers", backfill.DefaultWorkers, "segments of the key range read side by side, each in its own transactions (a resumed backfill keeps its own)")
	cmd.Flags().BoolVar(&restart, "restart", false, "start over, whether the last backfill is unfinished or finished (a finished one is otherwise not run again)")
	cmd.Flags().BoolVar(&pause, "pause", false, "pause the subscriber's running backfill (between chunks)")
	cmd.Flags().BoolVar(&resume, "resume", false, "resume the subscriber's paused backfill")
	return cmd
}

// backfillProgress prints rows, rate and ETA: a line redrawn every 500 ms
// on a terminal, a line every 5 s elsewhere.
type backfillProgress struct {
	w        io.Writer
	tty      bool
	start    time.Time
	last     time.Time
	fromDone int64
	started  bool
}

func newBackfillProgress(w io.Writer) *backfillProgress {
	p := &backfillProgress{w: w, start: time.Now()}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.tty = true
	}
	return p
}

func (p *backfillProgress) show(s backfill.Status) {
	if !p.started {
		p.started, p.fromDone, p.start = true, s.Done, time.Now()
	}
	every := 5 * time.Second
	if p.tty {
		every = 500 * time.Millisecond
	}
	if time.Since(p.last) < every || s.Finished() { // end prints the last line
		return
	}
	p.last = time.Now()
	p.print(s)
}

func (p *backfillProgress) print(s backfill.Status) {
	elapsed := time.Since(p.start)
	rate := 0.0
	if elapsed > 0 {
		rate = float64(s.Done-p.fromDone) / elapsed.Seconds()
	}
	eta := "?"
	if left := s.Total - s.Done - s.Failed; left <= 0 {
		eta = "0s"
	} else if rate > 0 {
		eta = (time.Duration(float64(left) / rate * float64(time.Second))).Round(time.Second).String()
	}
	pct := 100.0
	if s.Total > 0 {
		pct = 100 * float64(s.Done+s.Failed) / float64(s.Total)
	}
	state := ""
	if s.Paused {
		state = "  PAUSED (fanout backfill " + s.Subscriber + " --resume)"
	}
	line := fmt.Sprintf("backfill %s: %d/%d rows (%.1f%%)  %.0f rows/s  ETA %s  failed %d%s",
		s.Subscriber, s.Done, s.Total, pct, rate, eta, s.Failed, state)
	if p.tty {
		fmt.Fprintf(p.w, "\r%s%s", line, strings.Repeat(" ", 8))
		return
	}
	fmt.Fprintln(p.w, line)
}

func (p *backfillProgress) end(s backfill.Status) {
	if s.Subscriber == "" {
		return
	}
	if !p.started {
		p.started, p.fromDone = true, s.Done
	}
	p.print(s)
	if p.tty {
		fmt.Fprintln(p.w)
	}
}
