// Package testca makes a certificate authority and the certificates a
// test's servers present, so the tests run nats-server with TLS as the
// production configuration asks for it: a CA of the test's own, never one
// of the host's, that nothing outside the test trusts.
package testca

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// CA is a certificate authority whose certificate is in CAFile.
type CA struct {
	CAFile string
	dir    string
	cert   *x509.Certificate
	key    *ecdsa.PrivateKey
}

// Pair is a certificate and its key, as PEM files, and the certificate of
// the CA that signed it.
type Pair struct {
	CertFile, KeyFile, CAFile string
}

// Server makes a CA of its own in dir and a certificate it signed for a
// server on 127.0.0.1 or localhost: what a test's nats-server presents,
// and what its clients are told to trust.
func Server(dir string) (Pair, error) {
	ca, err := New(dir, "test")
	if err != nil {
		return Pair{}, err
	}
	return ca.Issue("server")
}

// New makes a CA valid for a day and writes its certificate into dir.
func New(dir, name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{CAFile: filepath.Join(dir, name+"-ca.pem"), dir: dir, cert: cert, key: key}
	return ca, writePEM(ca.CAFile, "CERTIFICATE", der)
}

// Issue makes a certificate for name, valid for 127.0.0.1, localhost and
// hosts, usable by a server and by a client (a cluster's route is both),
// and writes it and its key into the CA's directory.
func (ca *CA) Issue(name string, hosts ...string) (Pair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Pair{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return Pair{}, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return Pair{}, err
	}
	p := Pair{CertFile: filepath.Join(ca.dir, name+"-cert.pem"), KeyFile: filepath.Join(ca.dir, name+"-key.pem"), CAFile: ca.CAFile}
	if err := writePEM(p.CertFile, "CERTIFICATE", der); err != nil {
		return Pair{}, err
	}
	return p, writePEM(p.KeyFile, "PRIVATE KEY", keyDER)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		panic(fmt.Sprintf("testca: no randomness: %v", err))
	}
	return n
}

func writePEM(path, kind string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600)
}
