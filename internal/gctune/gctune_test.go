package gctune

import (
	"math"
	"runtime/debug"
	"testing"
)

// restore puts the collector's settings back after a test changed them.
func restore(t *testing.T) {
	percent := debug.SetGCPercent(100)
	debug.SetGCPercent(percent)
	limit := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetGCPercent(percent); debug.SetMemoryLimit(limit) })
}

func TestApplySetsTheRelaysCollector(t *testing.T) {
	restore(t)
	t.Setenv("GOGC", "")
	t.Setenv("GOMEMLIMIT", "")
	debug.SetGCPercent(100)
	debug.SetMemoryLimit(math.MaxInt64)
	s := Apply()
	if got := debug.SetGCPercent(100); got != Percent {
		t.Errorf("GOGC %d after Apply, want %d", got, Percent)
	}
	if s.MemoryLimit != MemoryLimit || debug.SetMemoryLimit(-1) != MemoryLimit {
		t.Errorf("memory limit %d (reported %d), want %d", debug.SetMemoryLimit(-1), s.MemoryLimit, MemoryLimit)
	}
}

func TestApplyLeavesTheEnvironmentsChoice(t *testing.T) {
	restore(t)
	t.Setenv("GOGC", "150")
	t.Setenv("GOMEMLIMIT", "1GiB")
	// The runtime read the variables at start; stand in for that.
	debug.SetGCPercent(150)
	debug.SetMemoryLimit(1 << 30)
	s := Apply()
	if got := debug.SetGCPercent(150); got != 150 {
		t.Errorf("GOGC %d after Apply, want the environment's 150", got)
	}
	if s.MemoryLimit != 1<<30 || s.GOGC != "150" || s.GOMEMLIMIT != "1GiB" {
		t.Errorf("Apply reported %+v, want the environment's settings", s)
	}
}
