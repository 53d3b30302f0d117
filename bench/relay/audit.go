package main

// The auditor (part audit): what it costs the drain, and how long an audit
// of a million rows takes.

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/relay"
	"github.com/nats-io/nats.go"
)

var (
	auditRows    = flag.Int("auditrows", 1_000_000, "rows of the audit part's full audit")
	auditProfile = flag.String("auditprofile", "", "write a CPU profile of the full audit (this process)")
)

// benchAudit prints, each figure over -runs runs: the poll and wal drains
// of -rows rows with the auditor off, on as configured by default (its
// continuous audit waits relay.audit_delay, 3m, so during a drain only the
// landings it records cost anything), and on with no delay (reading the
// stream back while the drain writes it); and the time of a dry-run audit
// of -auditrows published rows, every row against the stream.
func benchAudit(ctx context.Context, nc *nats.Conn) error {
	type variant struct {
		name  string
		wal   bool
		audit func(*relay.Config)
	}
	off := func(c *relay.Config) { c.Audit = false }
	def := func(c *relay.Config) {}
	eager := func(c *relay.Config) { c.AuditDelay, c.AuditInterval = 0, 100*time.Millisecond }
	variants := []variant{
		{"poll, auditor off", false, off}, {"poll, auditor on (defaults)", false, def}, {"poll, auditor on, no delay", false, eager},
		{"wal, auditor off", true, off}, {"wal, auditor on (defaults)", true, def}, {"wal, auditor on, no delay", true, eager},
	}
	figs := make([]benchkit.Figure, len(variants))
	ratios := make([]benchkit.Figure, len(variants))
	var full, fullRate benchkit.Figure
	for run := range *benchkit.Runs {
		rates := make([]float64, len(variants))
		// Alternating within each run: off, on, eager, for each capture.
		for i, v := range variants {
			res, err := drainWith(ctx, nc, v.wal, v.audit)
			if err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			rates[i] = res.rate
			figs[i].Add(res.rate)
		}
		for i := range variants {
			ratios[i].Add(rates[i] / rates[i/3*3])
		}
		secs, err := timeFullAudit(ctx, nc)
		if err != nil {
			return fmt.Errorf("full audit: %w", err)
		}
		full.Add(secs)
		fullRate.Add(float64(*auditRows) / secs)
		fmt.Printf("    run %d of %d: drains %.0f %.0f %.0f (poll) %.0f %.0f %.0f (wal) rows/s; audit of %d rows %.1fs\n",
			run+1, *benchkit.Runs, rates[0], rates[1], rates[2], rates[3], rates[4], rates[5], *auditRows, secs)
	}
	for i, v := range variants {
		fmt.Printf("(audit) drain of %d rows, %s: %s, against off %s\n", *rows, v.name, figs[i].Format("%.0f rows/s"), ratios[i].Format("%.3f"))
	}
	fmt.Printf("(audit) audit of %d published rows against the stream (fanout audit --dry-run): %s, %s (target <= 10 s)\n\n",
		*auditRows, full.Format("%.1f s"), fullRate.Format("%.0f rows/s"))
	return nil
}

// benchFullAudit is part auditfull: the full audit of benchAudit alone,
// -runs times (to profile it).
func benchFullAudit(ctx context.Context, nc *nats.Conn) error {
	for range *benchkit.Runs {
		secs, err := timeFullAudit(ctx, nc)
		if err != nil {
			return err
		}
		fmt.Printf("(audit) audit of %d published rows: %.1f s\n", *auditRows, secs)
	}
	return nil
}

// timeFullAudit publishes -auditrows rows (a poll relay drains them) and
// times a dry-run audit of every one against the stream.
func timeFullAudit(ctx context.Context, nc *nats.Conn) (float64, error) {
	env, err := newRelayEnv(ctx, nc, nil)
	if err != nil {
		return 0, err
	}
	defer env.close()
	if err := fillOutbox(ctx, env.db.Pool, *auditRows); err != nil {
		return 0, err
	}
	rc := relayConfig()
	rc.Audit = false
	saved := *rows
	*rows = *auditRows
	_, err = timeDrain(ctx, env.options(rc))
	*rows = saved
	if err != nil {
		return 0, err
	}
	if err := benchkit.Settle(ctx, env.db.Pool); err != nil {
		return 0, err
	}
	start := time.Now()
	if *auditProfile != "" {
		f, err := os.Create(*auditProfile)
		if err != nil {
			return 0, err
		}
		defer f.Close()
		_ = pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	rep, err := relay.Audit(ctx, env.options(rc), time.Time{}, true, nil)
	secs := time.Since(start).Seconds()
	if err != nil {
		return 0, err
	}
	if rep.Checked != int64(*auditRows) || rep.Missing != 0 {
		return 0, fmt.Errorf("the audit checked %d rows and found %d missing, want %d and 0", rep.Checked, rep.Missing, *auditRows)
	}
	return secs, nil
}
