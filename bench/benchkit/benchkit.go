// Package benchkit holds what the benchmark programs under bench/ share:
// their -nats, -postgres and -runs flags; the pipeline a subscriber
// benchmark runs on (Pipeline: a fresh database and streams, publishing a
// prepared outbox backlog, timing subscribers draining it); settling the
// database after a setup; and measuring each figure over several runs
// (-runs, default 3) to print their median and range.
package benchkit

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Config is the settings a benchmark runs the pipeline with: each
// package's defaults, as `fanout` runs without a file or a variable,
// unless the benchmark changes them.
type Config struct {
	Stream      stream.Config
	Relay       relay.Config
	Subscribers subscribers.Config
	Search      searchindex.Config
}

// DefaultConfig is each package's defaults.
func DefaultConfig() *Config {
	return &Config{Stream: stream.DefaultConfig(), Relay: relay.DefaultConfig(), Subscribers: subscribers.DefaultConfig(),
		Search: searchindex.DefaultConfig()}
}

// Quiet is a logger that drops everything.
var Quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Runs is how many times each figure is measured: every benchmark's -runs
// flag. This machine is small and shared, so one run proves little; the
// median of three, and their range, say how much a figure can be trusted.
var Runs = flag.Int("runs", 3, "how many times each figure is measured (the median and the range are printed)")

// CheckRuns refuses a -runs below 1 (there would be no figure to print).
func CheckRuns() error {
	if *Runs < 1 {
		return fmt.Errorf("-runs must be at least 1 (got %d)", *Runs)
	}
	return nil
}

// Rotation is the order n variants run in, in round (from 0): each round
// begins one variant later than the round before, so that no variant
// always runs first, or last, on a host that warms up or tires over the
// sitting.
func Rotation(round, n int) []int {
	order := make([]int, n)
	for k := range order {
		order[k] = (k + round) % n
	}
	return order
}

// Figure is one measured quantity over several runs.
type Figure struct{ Values []float64 }

// Add records one run's value.
func (f *Figure) Add(v float64) { f.Values = append(f.Values, v) }

// Median is the middle value (the mean of the two middle ones for an even
// count); 0 for no runs.
func (f Figure) Median() float64 {
	if len(f.Values) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(f.Values))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Format prints the median with format (say "%.0f rows/s"), then the range
// of the runs: "77620 rows/s (3 runs: 75100–79004)".
func (f Figure) Format(format string) string {
	med := fmt.Sprintf(format, f.Median())
	if len(f.Values) < 2 {
		return med
	}
	num := format
	if i := strings.Index(format, " "); i > 0 {
		num = format[:i] // the number's verb, without the unit after it
	}
	return fmt.Sprintf("%s (%d runs: %s–%s)", med, len(f.Values),
		fmt.Sprintf(num, slices.Min(f.Values)), fmt.Sprintf(num, slices.Max(f.Values)))
}

// Settle makes the benchmark database's state independent of the setup
// that filled it: a CHECKPOINT writes the setup's dirty pages now rather
// than during the measurement, and VACUUM ANALYZE leaves no dead rows and
// fresh statistics for autovacuum to catch up on while it runs. (A first
// run measured straight after a 100k-row setup once read a quarter of the
// next one's rate.) It needs a superuser or pg_checkpoint.
func Settle(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, `CHECKPOINT`); err != nil {
		return fmt.Errorf("settle the database: %w", err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE`); err != nil {
		return fmt.Errorf("settle the database: %w", err)
	}
	return nil
}

// Ms is d in milliseconds.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Latencies are a run's latencies: their median, 99th percentile and
// maximum, and how many there were.
type Latencies struct {
	P50, P99, Max time.Duration
	N             int
}

// Quantiles sorts ls and reads its Latencies (zero for none).
func Quantiles(ls []time.Duration) Latencies {
	if len(ls) == 0 {
		return Latencies{}
	}
	slices.Sort(ls)
	return Latencies{P50: ls[len(ls)/2], P99: ls[len(ls)*99/100], Max: ls[len(ls)-1], N: len(ls)}
}
