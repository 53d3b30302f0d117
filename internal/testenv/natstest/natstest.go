// Package natstest runs a real nats-server process (the pinned binary that
// deploy/services.sh installs into .bin/) for one test: its own port and
// JetStream store, so tests are isolated and may kill and restart it.
package natstest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/childproc"
	"github.com/fanout/fanout/internal/testenv/porthold"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Server is one nats-server process.
type Server struct {
	URL        string
	Port       int
	StoreDir   string
	args       []string
	clientOpts []nats.Option
	env        []string
	bin        string
	cmd        *exec.Cmd
	exited     chan struct{}
	log        *syncbuf.Buffer
	// hold keeps a stopped server's port until it restarts.
	hold porthold.Hold
}

// Option adjusts the server's command line.
type Option func(*Server)

// WithArgs adds nats-server command-line arguments.
func WithArgs(args ...string) Option {
	return func(s *Server) { s.args = append(s.args, args...) }
}

// WithEnv adds environment variables to the server process (its config
// file may read them).
func WithEnv(env ...string) Option {
	return func(s *Server) { s.env = append(s.env, env...) }
}

// WithPort runs the server on a given port instead of a free one.
func WithPort(port int) Option {
	return func(s *Server) {
		s.Port = port
		s.URL = fmt.Sprintf("nats://127.0.0.1:%d", port)
	}
}

// WithClientOptions are used by the readiness probe's connection (for a
// server that requires TLS, say).
func WithClientOptions(opts ...nats.Option) Option {
	return func(s *Server) { s.clientOpts = append(s.clientOpts, opts...) }
}

// Start runs a JetStream-enabled server for t and stops it when t ends.
func Start(t testing.TB, opts ...Option) *Server {
	t.Helper()
	s, err := StartServer(t.TempDir(), opts...)
	if err != nil {
		t.Fatalf("natstest: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// StartServer runs a JetStream-enabled server whose store lives under dir.
func StartServer(dir string, opts ...Option) (*Server, error) {
	bin, err := repo.Bin("nats-server")
	if err != nil {
		return nil, err
	}
	// A port found free may be taken before the server binds it (tests in
	// other packages start servers at the same time): try another.
	var lastErr error
	for range 5 {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		s := &Server{
			Port:     port,
			URL:      fmt.Sprintf("nats://127.0.0.1:%d", port),
			StoreDir: filepath.Join(dir, "jetstream"),
			bin:      bin,
		}
		for _, o := range opts {
			o(s)
		}
		if lastErr = s.start(); lastErr == nil || !errors.Is(lastErr, ErrPortTaken) {
			return s, lastErr
		}
	}
	return nil, lastErr
}

// ErrPortTaken is the start's error when the server could not bind its
// port (or, with a config file, its cluster port): another process holds it.
var ErrPortTaken = errors.New("port taken")

func (s *Server) start() error {
	args := append([]string{"-a", "127.0.0.1", "-p", strconv.Itoa(s.Port), "-js", "-sd", s.StoreDir}, s.args...)
	s.cmd = exec.Command(s.bin, args...)
	childproc.Tie(s.cmd)
	if len(s.env) > 0 {
		s.cmd.Env = append(os.Environ(), s.env...)
	}
	s.log = &syncbuf.Buffer{}
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("start nats-server: %w", err)
	}
	s.exited = make(chan struct{})
	go func() {
		_ = s.cmd.Wait()
		close(s.exited)
	}()
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := s.ready()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			s.signal(syscall.SIGKILL)
			return fmt.Errorf("nats-server on port %d not ready: %v\n%s", s.Port, err, s.log.String())
		}
		select {
		case <-s.exited:
			if strings.Contains(s.log.String(), "address already in use") {
				return fmt.Errorf("nats-server on port %d: %w:\n%s", s.Port, ErrPortTaken, s.log.String())
			}
			return fmt.Errorf("nats-server exited at start:\n%s", s.log.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// serverID is the ID the server printed at start ("ID: N..."), once it
// has.
var serverIDLine = regexp.MustCompile(`\[INF\]\s+ID:\s+(N[A-Z0-9]+)`)

func (s *Server) serverID() string {
	if m := serverIDLine.FindStringSubmatch(s.log.String()); m != nil {
		return m[1]
	}
	return ""
}

func (s *Server) ready() error {
	nc, err := nats.Connect(s.URL, append([]nats.Option{nats.Timeout(time.Second)}, s.clientOpts...)...)
	if err != nil {
		return err
	}
	defer nc.Close()
	// The port may answer for another test's server, if this one could not
	// bind it: only this process's own ID counts.
	if id := s.serverID(); id == "" || nc.ConnectedServerId() != id {
		return fmt.Errorf("the server on port %d is not this one (it is %s, this one printed %q)", s.Port, nc.ConnectedServerId(), id)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err
}

// Stop shuts the server down gracefully (SIGTERM); idempotent. Its port
// stays this server's until Restart (package porthold).
func (s *Server) Stop() { s.signal(syscall.SIGTERM); s.hold.Take(s.Port) }

// Kill kills the server (SIGKILL), as a power cut would; idempotent. Its
// port stays this server's until Restart (package porthold).
func (s *Server) Kill() { s.signal(syscall.SIGKILL); s.hold.Take(s.Port) }

// Close kills the server for good and lets its port go.
func (s *Server) Close() {
	s.signal(syscall.SIGKILL)
	s.hold.Release()
}

func (s *Server) signal(sig syscall.Signal) {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Signal(sig)
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}

// Restart starts the server again on the same port and store, after Stop
// or Kill.
func (s *Server) Restart() error {
	select {
	case <-s.exited:
	default:
		return errors.New("nats-server still running: Stop or Kill it first")
	}
	s.hold.Release()
	return s.start()
}

// Connect returns a client connection closed when t ends.
func (s *Server) Connect(t testing.TB) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(s.URL, nats.Timeout(5*time.Second))
	if err != nil {
		t.Fatalf("natstest: connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Log returns what the server printed.
func (s *Server) Log() string { return s.log.String() }

// Running reports whether the process is alive.
func (s *Server) Running() bool {
	select {
	case <-s.exited:
		return false
	default:
		return s.cmd != nil
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Snapshot copies the server's store, as a disk holds it at this moment,
// and returns where the copy is; the server must be stopped.
func (s *Server) Snapshot() (string, error) {
	if s.Running() {
		return "", errors.New("natstest: snapshot of a running server's store: stop it first")
	}
	dst, err := os.MkdirTemp(filepath.Dir(s.StoreDir), "snapshot-")
	if err != nil {
		return "", err
	}
	if err := os.CopyFS(dst, os.DirFS(s.StoreDir)); err != nil {
		return "", fmt.Errorf("natstest: snapshot the store: %w", err)
	}
	return dst, nil
}

// RollBack replaces the server's store with the snapshot's copy, as a
// disk that lost every write since would; the server must be stopped.
func (s *Server) RollBack(snapshot string) error {
	if s.Running() {
		return errors.New("natstest: roll back a running server's store: stop it first")
	}
	if err := os.RemoveAll(s.StoreDir); err != nil {
		return err
	}
	if err := os.CopyFS(s.StoreDir, os.DirFS(snapshot)); err != nil {
		return fmt.Errorf("natstest: roll the store back: %w", err)
	}
	return nil
}
