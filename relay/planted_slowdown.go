//go:build !fanout_planted_slowdown

package relay

// plantedSlowdown does nothing: the relay as shipped. Built with the tag
// fanout_planted_slowdown, it busy-waits 50 µs instead
// (planted_slowdown_on.go), so that bench:compare's test can show it finds
// a slowdown it was given.
func plantedSlowdown() {}
