//go:build !unix

package searchtest

import (
	"sync"
	"testing"
)

var settingsMu sync.Mutex

// lockSettings serializes within this process only: without flock, tests
// of several packages run at once may interleave their changes.
func lockSettings(testing.TB) (unlock func()) {
	settingsMu.Lock()
	return settingsMu.Unlock
}
