package connect_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// writeCA makes a CA and a server certificate for 127.0.0.1, as PEM files.
func writeCA(t *testing.T, dir string) (caFile, certFile, keyFile string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "fanout test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	write := func(name, typ string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	return write("ca.pem", "CERTIFICATE", caDER), write("server.pem", "CERTIFICATE", der), write("server-key.pem", "EC PRIVATE KEY", keyDER)
}

// nats.ca_file makes a TLS connection to a server with a private CA work;
// without it the connection is refused.
func TestNATSWithTLS(t *testing.T) {
	dir := t.TempDir()
	caFile, certFile, keyFile := writeCA(t, dir)
	server := natstest.Start(t, natstest.WithArgs("--tls", "--tlscert", certFile, "--tlskey", keyFile),
		natstest.WithClientOptions(nats.RootCAs(caFile)))
	cfg := connect.DefaultNATS()
	cfg.URL = "tls://" + server.URL[len("nats://"):]
	logger := slog.New(slog.DiscardHandler)
	if nc, err := connect.NATS(cfg, "test", logger); err == nil {
		nc.Close()
		t.Fatal("connected to a server with an unknown CA without nats.ca_file")
	}
	cfg.CAFile = caFile
	nc, err := connect.NATS(cfg, "test", logger)
	if err != nil {
		t.Fatalf("with nats.ca_file: %v", err)
	}
	defer nc.Close()
	if !nc.TLSRequired() {
		t.Error("the connection is not TLS")
	}
}

// A token given as a NATS URL's user authenticates (against a server that
// requires it), and stays out of the reconnect log line and out of the
// error of a refused token.
func TestNATSTokenStaysOutOfLogsAndErrors(t *testing.T) {
	const token = "NatsTokenS3cret"
	server := natstest.Start(t, natstest.WithArgs("--auth", token), natstest.WithClientOptions(nats.Token(token)))
	withToken := strings.Replace(server.URL, "nats://", "nats://"+token+"@", 1)
	cfg := connect.DefaultNATS()
	cfg.URL = withToken
	var logs syncbuf.Buffer
	logger := slog.New(slog.NewJSONHandler(&logs, nil))
	nc, err := connect.NATS(cfg, "test", logger)
	if err != nil {
		t.Fatalf("with the token in the URL: %v", err)
	}
	defer nc.Close()
	server.Stop()
	if err := server.Restart(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(logs.String(), "nats reconnected"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for the reconnect to be logged:\n%s", logs.String())
		}
	}
	if strings.Contains(logs.String(), token) || !strings.Contains(logs.String(), `"server":"nats://xxxxx@127.0.0.1:`) {
		t.Errorf("the reconnect log shows the token, or no server:\n%s", logs.String())
	}

	cfg.URL, cfg.Token = server.URL, "Wrong"+token
	if nc, err := connect.NATS(cfg, "test", logger); err == nil {
		nc.Close()
		t.Error("connected with a wrong token")
	} else if strings.Contains(err.Error(), token) || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Errorf("a refused token: %v; want an authorization error without the token", err)
	}
}

// A URL pgx or go-redis refuses is quoted in their errors: the password is
// not, and the reason is.
func TestURLParseErrorsHidePasswords(t *testing.T) {
	_, err := connect.PoolConfig(connect.PostgresConfig{URL: "postgres://fanout:ParseS3cret@db/fanout?sslmode=bogus&sslpassword=ParseS3cret2"}, "test")
	if err == nil || strings.Contains(err.Error(), "S3cret") || !strings.Contains(err.Error(), "sslmode") {
		t.Errorf("postgres: %v; want the bad sslmode named and no password", err)
	}
	_, err = connect.Postgres(context.Background(), connect.PostgresConfig{URL: "host=db user=fanout password=ParseS3cret sslmode=bogus"}, "test")
	if err == nil || strings.Contains(err.Error(), "S3cret") || !strings.Contains(err.Error(), "sslmode") {
		t.Errorf("postgres keyword/value: %v; want the bad sslmode named and no password", err)
	}
	_, err = connect.Redis(context.Background(), connect.RedisConfig{URL: "redis://cache:ParseS3cret@127.0.0.1:1/%zz", Timeout: time.Second})
	if err == nil || strings.Contains(err.Error(), "S3cret") || !strings.Contains(err.Error(), "redis.url") {
		t.Errorf("redis: %v; want redis.url named and no password", err)
	}
}
