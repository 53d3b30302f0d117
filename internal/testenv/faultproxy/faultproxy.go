// Package faultproxy is a TCP proxy on 127.0.0.1 that tests put between a
// process and a real server, to cut or slow the network between them
// without touching either: the network faults of the fault run, and the
// outages of the runtime tests.
package faultproxy

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy is a TCP proxy that can slow down or cut the connections it
// carries.
type Proxy struct {
	Addr   string
	target string
	ln     net.Listener
	delay  atomic.Int64 // per chunk, nanoseconds
	cut    atomic.Bool
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

// New forwards a new local port to target.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{Addr: ln.Addr().String(), target: target, ln: ln, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.cut.Load() {
			c.Close()
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Proxy) serve(c net.Conn) {
	defer p.wg.Done()
	up, err := net.DialTimeout("tcp", p.target, 2*time.Second)
	if err != nil {
		c.Close()
		return
	}
	// A cut that came while this connection was being set up (accepted
	// before it, dialled after it) closes it all the same: a connection
	// that outlived a cut would carry what the cut is there to stop.
	if !p.track(c, up) {
		c.Close()
		up.Close()
		return
	}
	defer p.untrack(c, up)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		buf := make([]byte, 32*1024)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				if d := p.delay.Load(); d > 0 {
					time.Sleep(time.Duration(d))
				}
				if _, werr := dst.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				if err != io.EOF {
					break
				}
				break
			}
		}
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go pipe(up, c)
	go pipe(c, up)
	<-done
	<-done
}

// track adds connections to those a cut closes, unless a cut is on.
func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut.Load() {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	for _, c := range cs {
		delete(p.conns, c)
	}
	p.mu.Unlock()
}

// Slow delays every chunk by d (0 restores full speed).
func (p *Proxy) Slow(d time.Duration) { p.delay.Store(int64(d)) }

// Cut drops every connection and refuses new ones until Restore.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.cut.Store(true)
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

// Restore lets connections through again at full speed.
func (p *Proxy) Restore() {
	p.cut.Store(false)
	p.delay.Store(0)
}

// Close stops the proxy and its connections.
func (p *Proxy) Close() {
	p.ln.Close()
	p.Cut()
	p.wg.Wait()
}
