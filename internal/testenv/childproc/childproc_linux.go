package childproc

import (
	"os/exec"
	"syscall"
)

// The parent-death signal is sent when the thread that started the child
// exits; the Go runtime keeps its threads for the process's life (none of
// the tests locks one to a goroutine that ends), so this is the process's
// death.
func tie(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
