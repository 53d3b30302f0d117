package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/relay"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
)

// The held-horizon run: under a steady write rate, a transaction holds its
// snapshot open (a long report, a stuck session, a logical backup do), so
// vacuum can remove no row version that died after it began. A queue that
// updates and deletes its rows (the poll relay's claim and mark) piles up
// dead versions its claim has to step over; an append-only log read from
// the WAL (the wal relay) should not notice.

// horizonPhases, in order: before the snapshot is taken, while it is held,
// and after it is released.
var horizonPhases = []string{"before", "held", "after"}

const horizonTick = 10 * time.Second

// horizonObserver records every PubAck and every claim.
type horizonObserver struct {
	latencyObserver
	claims []claimSample
}

type claimSample struct {
	at   time.Time
	took time.Duration
}

func (o *horizonObserver) Claimed(_ int, took time.Duration) {
	o.mu.Lock()
	o.claims = append(o.claims, claimSample{time.Now(), took})
	o.mu.Unlock()
}

// horizonSample is one tick's reading of the database.
type horizonSample struct {
	at          time.Time
	deadTuples  int64 // the outbox's, as the statistics last counted them
	unpublished int64 // poll: rows not yet marked sent
	slotLag     int64 // wal: bytes of WAL the slot has not confirmed
}

// horizonPhase is one phase of one run.
type horizonPhase struct {
	publishedPerSec float64
	p99Ms           float64
	claimMs         float64 // mean; 0 in wal capture
	deadTuples      int64   // at the phase's end
	unpublished     int64   // at the phase's end
	slotLagMax      int64
}

// horizonRun is one run: its phases and its time series.
type horizonRun struct {
	phases [3]horizonPhase
	series []horizonTickRow
}

type horizonTickRow struct {
	at time.Duration // since the writes began
	horizonPhase
	sample horizonSample
}

func benchHorizon(ctx context.Context, nc *nats.Conn) error {
	settle := 30 * time.Second
	fmt.Printf("held horizon: %d writes/s; after %s a REPEATABLE READ transaction holds its snapshot for %s, then %s more; %d runs of each\n",
		*latencyRate, settle, *horizonFor, settle, *benchkit.Runs)
	if *horizonAtomic != "" {
		fmt.Printf("    relay.atomic=%s\n", *horizonAtomic)
	}
	variants := []struct{ name, capture string }{
		{"relay.capture=poll (claim, mark sent)", relay.CapturePoll},
		{"relay.capture=wal (decoded from the replication slot)", relay.CaptureWAL},
	}
	if *captureOnly != "" {
		variants = slices.DeleteFunc(variants, func(v struct{ name, capture string }) bool { return v.capture != *captureOnly })
		if len(variants) == 0 {
			return fmt.Errorf("-capture %q: want poll or wal", *captureOnly)
		}
	}
	runs := make([][]horizonRun, len(variants))
	for run := range *benchkit.Runs {
		for _, i := range benchkit.Rotation(run, len(variants)) {
			hr, err := measureHorizon(ctx, nc, variants[i].capture, settle)
			if err != nil {
				return fmt.Errorf("%s: %w", variants[i].name, err)
			}
			runs[i] = append(runs[i], hr)
		}
	}
	for i, v := range variants {
		wal := v.capture == relay.CaptureWAL
		fmt.Printf("    %s\n", v.name)
		var rate, p99 [3]benchkit.Figure
		for p, phase := range horizonPhases {
			var claim, dead, unpublished, lag benchkit.Figure
			for _, r := range runs[i] {
				ph := r.phases[p]
				rate[p].Add(ph.publishedPerSec)
				p99[p].Add(ph.p99Ms)
				claim.Add(ph.claimMs)
				dead.Add(float64(ph.deadTuples))
				unpublished.Add(float64(ph.unpublished))
				lag.Add(float64(ph.slotLagMax))
			}
			line := fmt.Sprintf("        %-6s published %s  commit→PubAck p99 %s", phase, rate[p].Format("%.0f/s"), p99[p].Format("%.1fms"))
			if wal {
				line += fmt.Sprintf("  slot lag max %s", lag.Format("%.0f bytes"))
			} else {
				line += fmt.Sprintf("  claim %s  unpublished at the end %s", claim.Format("%.2fms"), unpublished.Format("%.0f"))
			}
			line += fmt.Sprintf("  outbox dead tuples at the end %s", dead.Format("%.0f"))
			fmt.Println(line)
		}
		var rateRatio, p99Ratio benchkit.Figure
		for _, r := range runs[i] {
			rateRatio.Add(r.phases[1].publishedPerSec / r.phases[0].publishedPerSec)
			p99Ratio.Add(r.phases[1].p99Ms / r.phases[0].p99Ms)
		}
		fmt.Printf("        held/before: published/s %s, p99 %s\n", rateRatio.Format("%.2f"), p99Ratio.Format("%.2f"))
		last := runs[i][len(runs[i])-1]
		fmt.Printf("        over time (the last run, every %s):\n", horizonTick)
		for _, t := range last.series {
			extra := fmt.Sprintf("claim %6.2fms  unpublished %7d", t.claimMs, t.sample.unpublished)
			if wal {
				extra = fmt.Sprintf("slot lag %9d bytes", t.sample.slotLag)
			}
			fmt.Printf("          %4.0fs  published %5.0f/s  p99 %7.1fms  %s  dead tuples %8d\n",
				t.at.Seconds(), t.publishedPerSec, t.p99Ms, extra, t.sample.deadTuples)
		}
	}
	fmt.Println("    target for wal: no slowdown while the snapshot is held (published/s and p99 held/before about 1)")
	fmt.Println()
	return nil
}

// measureHorizon is one run of a capture: the steady writes for settle,
// then while a snapshot is held for -horizon, then for settle again,
// sampled every horizonTick.
func measureHorizon(ctx context.Context, nc *nats.Conn, capture string, settle time.Duration) (horizonRun, error) {
	obs := &horizonObserver{latencyObserver: latencyObserver{acked: map[int64]time.Time{}}}
	env, err := startSteadyEnv(ctx, nc, func(c *relay.Config) {
		c.Capture = capture
		if *horizonAtomic != "" {
			c.Atomic = *horizonAtomic
		}
	}, obs)
	if err != nil {
		return horizonRun{}, err
	}
	defer env.close()

	holder, err := pgx.Connect(ctx, env.db.URL)
	if err != nil {
		return horizonRun{}, err
	}
	defer holder.Close(context.Background())

	// The phases' bounds: the start, the snapshot taken, released, the end.
	start := time.Now()
	bounds := []time.Time{start, start.Add(settle), start.Add(settle + *horizonFor), start.Add(settle + *horizonFor + settle)}
	runCtx, cancel := context.WithTimeout(ctx, bounds[3].Sub(start))
	defer cancel()

	var committed map[int64]time.Time
	var wg sync.WaitGroup
	wg.Go(func() { committed = env.writeSteadily(runCtx) })
	samples, err := env.sampleWhileHeld(ctx, runCtx, cancel, holder, capture, bounds[1], bounds[2])
	wg.Wait()
	if err != nil {
		return horizonRun{}, err
	}
	if len(samples) == 0 || time.Since(samples[len(samples)-1].at) > horizonTick/2 {
		s, err := sampleHorizon(ctx, env, capture)
		if err != nil {
			return horizonRun{}, err
		}
		s.at = time.Now()
		samples = append(samples, s)
	}
	time.Sleep(2 * time.Second) // the last PubAcks

	if missing := len(committed) - len(obs.latencies(committed)); missing > 0 {
		return horizonRun{}, fmt.Errorf("%d of %d committed events not published within 2s of the end", missing, len(committed))
	}
	return obs.horizonRun(committed, samples, bounds), nil
}

// sampleWhileHeld samples the database every horizonTick until runCtx
// ends (or a sample fails), and has holder hold a snapshot from holdFrom
// to holdTo. It ends the run (cancel) before it returns, once the holder
// has let go. The samples are read under ctx: one begun as the run ends
// is still read.
func (env *steadyEnv) sampleWhileHeld(ctx, runCtx context.Context, cancel func(), holder *pgx.Conn, capture string, holdFrom, holdTo time.Time) ([]horizonSample, error) {
	var samples []horizonSample
	holdErr := make(chan error, 1)
	held := false
	holdAt := time.NewTimer(time.Until(holdFrom))
	defer holdAt.Stop()
	tick := time.NewTicker(horizonTick)
	defer tick.Stop()
	var sampleErr error
	for runCtx.Err() == nil && sampleErr == nil {
		select {
		case <-runCtx.Done():
		case <-holdAt.C:
			held = true
			go func() { holdErr <- holdSnapshot(runCtx, holder, time.Until(holdTo)) }()
		case now := <-tick.C:
			var s horizonSample
			if s, sampleErr = sampleHorizon(ctx, env, capture); sampleErr == nil {
				s.at = now
				samples = append(samples, s)
			}
		}
	}
	cancel()
	if held {
		// The holder's connection is closed only after its transaction.
		if err := <-holdErr; err != nil && sampleErr == nil {
			return nil, fmt.Errorf("hold a snapshot: %w", err)
		}
	}
	return samples, sampleErr
}

// horizonRun reads a run's phases, between bounds, and its time series,
// a row a sample, from the events committed and acked, the claims and
// the samples.
func (o *horizonObserver) horizonRun(committed map[int64]time.Time, samples []horizonSample, bounds []time.Time) horizonRun {
	o.mu.Lock()
	defer o.mu.Unlock()
	var hr horizonRun
	for p := range horizonPhases {
		ph := window(committed, o.acked, o.claims, bounds[p], bounds[p+1])
		for _, s := range samples {
			if !s.at.After(bounds[p+1].Add(horizonTick / 2)) {
				ph.deadTuples, ph.unpublished = s.deadTuples, s.unpublished
			}
			if !s.at.Before(bounds[p]) && !s.at.After(bounds[p+1]) {
				ph.slotLagMax = max(ph.slotLagMax, s.slotLag)
			}
		}
		hr.phases[p] = ph
	}
	for _, s := range samples {
		ph := window(committed, o.acked, o.claims, s.at.Add(-horizonTick), s.at)
		hr.series = append(hr.series, horizonTickRow{at: s.at.Sub(bounds[0]).Round(time.Second), horizonPhase: ph, sample: s})
	}
	return hr
}

// holdSnapshot takes a snapshot in a REPEATABLE READ transaction and keeps
// it for d.
func holdSnapshot(ctx context.Context, conn *pgx.Conn, d time.Duration) error {
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return err
	}
	var n int64
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil {
		_ = tx.Rollback(context.Background())
		return err
	}
	select {
	case <-time.After(d):
	case <-ctx.Done():
	}
	return tx.Rollback(context.Background())
}

func sampleHorizon(ctx context.Context, env *steadyEnv, capture string) (horizonSample, error) {
	var s horizonSample
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	// The statistics a backend reports at most once a second; the outbox's
	// rows are in its ranges (partitions), which have the statistics.
	if err := env.pool.QueryRow(ctx, `
SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
WHERE relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox'::regclass)`).Scan(&s.deadTuples); err != nil {
		return s, fmt.Errorf("read the outbox's dead tuples: %w", err)
	}
	if capture == relay.CaptureWAL {
		err := env.pool.QueryRow(ctx, `
SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::bigint
FROM pg_replication_slots WHERE slot_name = $1`, env.db.Name).Scan(&s.slotLag)
		if err != nil {
			return s, fmt.Errorf("read the slot's lag: %w", err)
		}
		return s, nil
	}
	err := env.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&s.unpublished)
	if err != nil {
		return s, fmt.Errorf("count unpublished rows: %w", err)
	}
	return s, nil
}

// window measures the events acked, committed and claims made in [from, to).
func window(committed, acked map[int64]time.Time, claims []claimSample, from, to time.Time) horizonPhase {
	var ph horizonPhase
	in := func(t time.Time) bool { return !t.Before(from) && t.Before(to) }
	n := 0
	var lat []time.Duration
	for id, c := range committed {
		a, ok := acked[id]
		if ok && in(a) {
			n++
		}
		if ok && in(c) {
			lat = append(lat, max(a.Sub(c), 0)) // as in latencies
		}
	}
	ph.publishedPerSec = float64(n) / to.Sub(from).Seconds()
	ph.p99Ms = benchkit.Ms(benchkit.Quantiles(lat).P99)
	var took time.Duration
	k := 0
	for _, c := range claims {
		if in(c.at) {
			took += c.took
			k++
		}
	}
	if k > 0 {
		ph.claimMs = benchkit.Ms(took / time.Duration(k))
	}
	return ph
}
