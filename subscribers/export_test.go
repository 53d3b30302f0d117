package subscribers

import "context"

// Crash stops r as if its process had been killed: handlers are cut off
// and nothing more is written or acked.
func Crash(r *Runner) {
	r.crashed.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = r.Stop(ctx)
}
