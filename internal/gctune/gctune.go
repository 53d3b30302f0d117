// Package gctune gives a relay process's garbage collector more room than
// Go's default. A relay allocates a message, its headers and its PubAck
// for every event and keeps little alive; at GOGC 100 a quarter of a wal
// drain's relay profile was allocation and collection. At 400 the relay
// used 16 µs of CPU a row instead of 18 to 20 and drained 6 to 10 % faster
// (docs/benchmarks.md), its peak Go memory in a 300,000-event transaction
// 66 to 105 MB instead of 28 to 37. The soft memory limit makes the
// collector work harder before the heap grows past it, not fail.
package gctune

import (
	"os"
	"runtime/debug"
)

const (
	// Percent is the relay's GOGC.
	Percent = 400
	// MemoryLimit is the relay's GOMEMLIMIT, 256 MiB: the relay's memory
	// target (docs/benchmarks.md, big transactions).
	MemoryLimit = 256 << 20
)

// Settings is what the collector runs with after Apply.
type Settings struct {
	// GOGC and GOMEMLIMIT are the environment's values, which win over
	// the relay's ("" where unset: Percent and MemoryLimit apply).
	GOGC, GOMEMLIMIT string
	MemoryLimit      int64 // bytes
}

// Apply sets Percent and MemoryLimit, each unless the environment sets
// GOGC or GOMEMLIMIT (an operator's choice, which the Go runtime has
// applied already), and returns what the collector runs with.
func Apply() Settings {
	s := Settings{GOGC: os.Getenv("GOGC"), GOMEMLIMIT: os.Getenv("GOMEMLIMIT")}
	if s.GOGC == "" {
		debug.SetGCPercent(Percent)
	}
	if s.GOMEMLIMIT == "" {
		debug.SetMemoryLimit(MemoryLimit)
	}
	s.MemoryLimit = debug.SetMemoryLimit(-1) // a negative limit reads it
	return s
}
