package relay

// TestHooks break the relay's guarantees on purpose, for the fault run's
// self-test only (it proves the checker catches it). Production leaves them
// zero: only tests, and binaries built with the fanout_sabotage tag, set
// them. The subscriber runtime has the same kind.
type TestHooks struct {
	// SkipPublish, if set, names rows the relay marks sent without
	// publishing them.
	SkipPublish func(id int64) bool
	// FailPublish, if set, names rows whose publish fails as if NATS were
	// unreachable (the relay retries them).
	FailPublish func(id int64) bool
	// Unordered publishes without per-aggregate order: the claim takes an
	// aggregate's events while earlier ones are unpublished, and the wal
	// relay publishes them without waiting for the one before.
	Unordered bool
}
