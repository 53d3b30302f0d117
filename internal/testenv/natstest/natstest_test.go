package natstest

import (
	"errors"
	"testing"
)

// A server whose port another server holds does not pass for started: the
// readiness check would otherwise reach the other server and a test would
// run against someone else's streams.
func TestServerOnATakenPortIsNotStarted(t *testing.T) {
	first := Start(t)
	s, err := StartServer(t.TempDir(), WithPort(first.Port))
	if err == nil {
		s.Stop()
		t.Fatalf("a second server on port %d reported started", first.Port)
	}
	if !errors.Is(err, ErrPortTaken) {
		t.Fatalf("error %v, want it to say the port is taken", err)
	}
	if !first.Running() {
		t.Fatal("the first server stopped")
	}
}

// A stopped server keeps its port until it restarts: a server another test
// starts meanwhile cannot take it, or this test's clients, reconnecting,
// would publish into that server's streams.
func TestStoppedServerKeepsItsPort(t *testing.T) {
	first := Start(t)
	first.Stop()
	s, err := StartServer(t.TempDir(), WithPort(first.Port))
	if err == nil {
		s.Close()
		t.Fatalf("another server started on port %d while its server was stopped", first.Port)
	}
	if !errors.Is(err, ErrPortTaken) {
		t.Fatalf("error %v, want it to say the port is taken", err)
	}
	if err := first.Restart(); err != nil {
		t.Fatalf("restart on the held port: %v", err)
	}
	if !first.Running() {
		t.Fatal("the restarted server is not running")
	}
}
