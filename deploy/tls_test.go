package deploy_test

import (
	"bufio"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/testca"
	"github.com/nats-io/nats.go"
)

// Under the production configuration a client talks to NATS over TLS or
// not at all: a login sent in the clear gets no answer but a closed
// connection, a client that does not trust the server's CA does not
// connect, and a role given nats.ca_file refuses a server that offers no
// TLS (a man in the middle that strips it).
func TestNATSClientsConnectOverTLSOnly(t *testing.T) {
	t.Parallel()
	ns := startNATS(t)

	t.Run("a login in the clear is refused", func(t *testing.T) {
		conn, err := net.DialTimeout("tcp", strings.TrimPrefix(ns.url, "nats://"), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
		r := bufio.NewReader(conn)
		info, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("read the server's INFO: %v", err)
		}
		if !strings.Contains(info, `"tls_required":true`) {
			t.Errorf("the server's INFO does not require TLS: %s", info)
		}
		if _, err := io.WriteString(conn, `CONNECT {"user":"relay","pass":"`+ns.passwords["relay"]+`","verbose":true}`+"\r\nPING\r\n"); err != nil {
			t.Fatal(err)
		}
		rest, err := io.ReadAll(r)
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("the connection is still open 30 s after a login in the clear (read %q)", rest)
		}
		if strings.Contains(string(rest), "+OK") || strings.Contains(string(rest), "PONG") {
			t.Errorf("the server answered a login in the clear: %q", rest)
		}
	})

	t.Run("a client that does not trust the server's CA is refused", func(t *testing.T) {
		other, err := testca.New(t.TempDir(), "other")
		if err != nil {
			t.Fatal(err)
		}
		nc, err := nats.Connect(ns.url, nats.UserInfo("relay", ns.passwords["relay"]), nats.RootCAs(other.CAFile), nats.Timeout(10*time.Second))
		if err == nil {
			nc.Close()
			t.Fatal("connected trusting another CA")
		}
		if !strings.Contains(err.Error(), "certificate signed by unknown authority") {
			t.Errorf("got %v, want the server's certificate refused", err)
		}
	})

	t.Run("a role with a CA refuses a server without TLS", func(t *testing.T) {
		plain := natstest.Start(t)
		cfg := connect.NATSConfig{URL: plain.URL, CAFile: ns.caFile, ConnectTimeout: 10 * time.Second}
		nc, err := connect.NATS(cfg, "tls-test", slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err == nil {
			nc.Close()
			t.Fatal("connected to a server without TLS")
		}
		if !strings.Contains(err.Error(), "secure connection") {
			t.Errorf("got %v, want a secure connection asked for", err)
		}
	})
}
