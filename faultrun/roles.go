package faultrun

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/fanout/fanout/internal/testenv/childproc"
)

// Role is one fanout process of the pipeline, restartable; its output goes
// to a log file that survives its restarts.
type Role struct {
	Name string
	Args []string
	bin  string
	env  []string
	log  *os.File

	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{}
	restarts int
}

func newRole(name, bin, logDir string, env []string, args ...string) (*Role, error) {
	f, err := os.Create(filepath.Join(logDir, name+".log"))
	if err != nil {
		return nil, err
	}
	return &Role{Name: name, Args: args, bin: bin, env: env, log: f}, nil
}

// Start runs the process (again), unless it runs: two of the run's loops
// may each find it gone and start it (a fault's restart, a late
// subscriber's supervisor), and the second must not leave the first's
// process running unwatched, which nothing would stop.
func (r *Role) Start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.exited != nil {
		select {
		case <-r.exited:
		default:
			return nil
		}
	}
	cmd := exec.Command(r.bin, r.Args...) // r.mu is held
	childproc.Tie(cmd)
	cmd.Env = r.env
	cmd.Stdout, cmd.Stderr = r.log, r.log
	fmt.Fprintf(r.log, "{\"msg\":\"chaos: starting %s\",\"time\":%q}\n", r.Name, time.Now().Format(time.RFC3339Nano))
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	r.cmd, r.exited = cmd, exited
	return nil
}

// Kill sends SIGKILL and waits for the process to be gone.
func (r *Role) Kill() {
	r.signal(syscall.SIGKILL, time.Second)
}

// Stop sends SIGTERM (the graceful drain) and waits.
func (r *Role) Stop() {
	r.signal(syscall.SIGTERM, 45*time.Second)
}

func (r *Role) signal(sig syscall.Signal, wait time.Duration) {
	r.mu.Lock()
	cmd, exited := r.cmd, r.exited
	r.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-exited:
	case <-time.After(wait):
		_ = cmd.Process.Kill()
		<-exited
	}
}

// SetArgs changes the arguments of the process's next start.
func (r *Role) SetArgs(args ...string) {
	r.mu.Lock()
	r.Args = args
	r.mu.Unlock()
}

// Alive reports whether the process runs.
func (r *Role) Alive() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.exited == nil {
		return false
	}
	select {
	case <-r.exited:
		return false
	default:
		return true
	}
}

// Restart kills the process and starts it again.
func (r *Role) Restart() error {
	r.Kill()
	r.mu.Lock()
	r.restarts++
	r.mu.Unlock()
	return r.Start()
}

func (r *Role) close() {
	r.Kill()
	r.log.Close()
}
