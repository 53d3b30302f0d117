// Package redistest runs a real redis-server process (from the Debian
// package deploy/services.sh installs) for one test, on a free port with no
// persistence.
package redistest

import (
	"bytes"
	"context"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

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
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port)}
	s.URL = "redis://" + s.Addr + "/0"
	var out bytes.Buffer
	s.cmd = exec.Command(bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--save", "", "--appendonly", "no", "--dir", t.TempDir())
	s.cmd.Stdout, s.cmd.Stderr = &out, &out
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("redistest: start: %v", err)
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
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := rdb.Ping(ctx).Err()
		cancel()
		if err == nil {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest: redis-server on %s not ready: %v\n%s", s.Addr, err, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Client returns a client closed when t ends.
func (s *Server) Client(t testing.TB) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}
