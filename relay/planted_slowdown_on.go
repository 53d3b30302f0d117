//go:build fanout_planted_slowdown

package relay

import "time"

// plantedSlowdown spends about 50 µs of CPU on each row's message: a
// known slowdown for bench:compare's test to find (bench/compare), built
// only with the tag fanout_planted_slowdown. A busy wait, not a sleep: a
// 50 µs time.Sleep lasted 1.1 ms on the 2-core host the benchmarks run on
// (the timer's resolution), and a wait that leaves the CPU free hides
// behind the relay's concurrent deliveries while Postgres bounds the
// drain (a yielding wait read 0.87 of the drain, where this one reads
// about 0.6). Most regressions of a hot path are CPU, too.
func plantedSlowdown() {
	for start := time.Now(); time.Since(start) < 50*time.Microsecond; {
	}
}
