// Package childproc ties the processes tests start (servers, fanout
// roles) to the test binary's life. A test that fails runs its cleanups
// and stops them; a test binary that dies without cleaning up (killed, or
// past -timeout, which panics without running cleanups) would leave them
// running, holding ports and loading the machine for the tests after it.
// Tied processes get SIGKILL from the kernel when the test binary dies.
package childproc

import "os/exec"

// Tie makes cmd, not yet started, die with this process.
func Tie(cmd *exec.Cmd) { tie(cmd) }
