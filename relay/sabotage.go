package relay

// Sabotage breaks the relay's guarantees on purpose, for the fault run's
// self-test only (it proves the checker catches it). Never set it in
// production: only a binary built with the fanout_sabotage tag does.
type Sabotage struct {
	// SkipPublish, if set, names rows the relay marks sent without
	// publishing them.
	SkipPublish func(id int64) bool
}
