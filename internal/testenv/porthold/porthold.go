// Package porthold keeps the port of a test server that is stopped for a
// while (an outage the test makes) from the servers other tests start
// meanwhile: they take ports found free, and the OS may hand out this one.
// The stopped server's clients, reconnecting, would then reach another
// test's server (a relay test once published into another test's stream
// of the same name). While held, connections are accepted and closed at
// once, as a server that is down refuses them.
package porthold

import (
	"net"
	"strconv"
	"sync"
)

// Hold is one port held, or none; the zero value holds none.
type Hold struct {
	mu sync.Mutex
	l  net.Listener
}

// Take holds 127.0.0.1:port until Release. Nothing if it holds one
// already, or the port is taken (the server's restart will say so).
func (h *Hold) Take(port int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.l != nil || port == 0 {
		return
	}
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return
	}
	h.l = l
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
}

// Release lets the held port go, for the server to bind it again.
func (h *Hold) Release() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.l != nil {
		h.l.Close()
		h.l = nil
	}
}
