package opsserver

import (
	"net"
	"strings"

	"github.com/fanout/fanout/internal/validate"
)

// Config is each role's operations endpoint (the http.* keys).
type Config struct {
	// Addr is host:port to listen on; empty disables the endpoint.
	// Default 127.0.0.1:9464 (containers set 0.0.0.0:9464).
	Addr string `koanf:"addr"`
	// Peers are the operations endpoints (host:port, comma-separated) of
	// the running roles, which `fanout status` reads the last minute's
	// stage latencies from. Empty: Addr, where `fanout up` serves every
	// role's. Default empty.
	Peers string `koanf:"peers"`
}

// DefaultConfig returns the http.* defaults.
func DefaultConfig() Config { return Config{Addr: "127.0.0.1:9464"} }

// Validate checks the http.* keys, naming every key that is wrong.
func (c Config) Validate() error {
	var v validate.Errors
	if c.Addr != "" {
		if _, _, err := net.SplitHostPort(c.Addr); err != nil {
			v.Bad("http.addr", "must be host:port such as 0.0.0.0:9464, or empty to disable (got %q)", c.Addr)
		}
	}
	for _, p := range strings.Split(c.Peers, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if _, port, err := net.SplitHostPort(p); err != nil || port == "0" {
			v.Bad("http.peers", "must be comma-separated host:port pairs such as relay:9464,searchindex:9464 (got %q)", p)
		}
	}
	return v.Err()
}

// PeerList is Peers as a list, or Addr when Peers is empty (and nothing
// when both are). An address listening on every interface (0.0.0.0:9464,
// :9464) is read on the loopback.
func (c Config) PeerList() []string {
	raw := c.Peers
	if strings.TrimSpace(raw) == "" {
		raw = c.Addr
	}
	var out []string
	for _, p := range strings.Split(raw, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		host, port, err := net.SplitHostPort(p)
		if err == nil && port == "0" {
			continue // a port picked at start: nothing to find there
		}
		if err == nil && (host == "" || host == "0.0.0.0" || host == "::") {
			p = net.JoinHostPort("127.0.0.1", port)
		}
		out = append(out, p)
	}
	return out
}
