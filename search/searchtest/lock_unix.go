//go:build unix

package searchtest

import (
	"os"
	"syscall"
	"testing"
)

// lockSettings takes an exclusive lock on settingsLockFile, waiting for
// any other test process holding it. The kernel releases it if the process
// dies.
func lockSettings(t testing.TB) (unlock func()) {
	t.Helper()
	f, err := os.OpenFile(settingsLockFile, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		t.Fatalf("searchtest: open %s: %v", settingsLockFile, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		t.Fatalf("searchtest: lock %s: %v", settingsLockFile, err)
	}
	return func() { _ = f.Close() } // closing the last descriptor releases the lock
}
