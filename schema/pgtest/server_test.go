package pgtest

import (
	"net"
	"strconv"
	"testing"
)

// A stopped server keeps its port until it starts again: another test's
// server, started meanwhile on a port found free, cannot be handed it, or
// this test's clients, reconnecting, would reach that server.
func TestStoppedServerKeepsItsPort(t *testing.T) {
	s := StartServer(t)
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
	if l, err := net.Listen("tcp", addr); err == nil {
		l.Close()
		t.Fatalf("port %d of a stopped server could be taken", s.port)
	}
	if err := s.Start(); err != nil {
		t.Fatalf("start again on the held port: %v", err)
	}
}
