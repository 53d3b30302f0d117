package relay

// TestHooks break the relay's guarantees on purpose, for the fault run's
// self-test only (it proves the checker catches it). Production leaves them
// zero: only tests, and binaries built with the fanout_sabotage tag, set
// them. The subscriber runtime has the same kind.
type TestHooks struct {
	// SkipPublish, if set, names rows the relay marks sent without
	// publishing them.
	SkipPublish func(id int64) bool
}
