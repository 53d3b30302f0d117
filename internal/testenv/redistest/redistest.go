// Package redistest runs a real redis-server process (from the Debian
// package deploy/services.sh installs) for one test, on a free port with no
// persistence.
package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/childproc"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/redis/go-redis/v9"
)

// Server is one redis-server process.
type Server struct {
	URL  string
	Addr string
	cmd  *exec.Cmd
}

// Start runs a server for t, stopped when t ends; the test fails if
// redis-server is not installed or does not answer.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redistest: redis-server not found (install it with deploy/services.sh up): %v", err)
	}
	// A port found free may be taken before the server binds it (tests in
	// other packages start servers at the same time): try another.
	for range 5 {
		s, err := start(t, bin)
		if err == nil {
			return s
		}
		if !errors.Is(err, errPortTaken) {
			t.Fatalf("redistest: %v", err)
		}
	}
	t.Fatal("redistest: no free port after 5 tries")
	return nil
}

// errPortTaken: the server could not bind its port.
var errPortTaken = errors.New("port taken")

func start(t testing.TB, bin string) (*Server, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port)}
	s.URL = "redis://" + s.Addr + "/0"
	out := &syncbuf.Buffer{}
	s.cmd = exec.Command(bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--save", "", "--appendonly", "no", "--dir", t.TempDir())
	childproc.Tie(s.cmd)
	s.cmd.Stdout, s.cmd.Stderr = out, out
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start: %w", err)
	}
	exited := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = s.cmd.Process.Kill()
		<-exited
	})
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		// Only this process counts: the port may answer for another
		// test's server, if this one could not bind it.
		err := ours(rdb, s.cmd.Process.Pid)
		if err == nil {
			return s, nil
		}
		select {
		case <-exited:
			if strings.Contains(out.String(), "Address already in use") {
				return nil, fmt.Errorf("redis-server on %s: %w", s.Addr, errPortTaken)
			}
			return nil, fmt.Errorf("redis-server on %s exited at start:\n%s", s.Addr, out.String())
		default:
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("redis-server on %s not ready: %v\n%s", s.Addr, err, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ours checks that the server answering is the process pid.
func ours(rdb *redis.Client, pid int) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return err
	}
	if !strings.Contains(info, "process_id:"+strconv.Itoa(pid)+"\r\n") {
		return fmt.Errorf("the server answering is not process %d", pid)
	}
	return nil
}

// Client returns a client closed when t ends.
func (s *Server) Client(t testing.TB) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}
