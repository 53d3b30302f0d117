package deploy_test

// These tests run the real relay and subscribers under the production
// nats-server configuration (deploy/nats/nats-server.conf) and the database
// roles of deploy/postgres/roles.sql, and show what each role may and may
// not do: every refusal is the server's own (a NATS permissions violation
// naming the subject, SQLSTATE 42501 from PostgreSQL).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/testenv/childproc"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/fanout/fanout/internal/testenv/testca"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/crypto/bcrypt"
)

// ---------------------------------------------------------------------------
// nats-server under deploy/nats/nats-server.conf

// natsUsers are the users of the configuration file: fanout's own roles,
// the administrators of the two streams' accounts, and a user per
// subscriber in the registry.
var natsUsers = append([]string{"relay", "provisioner", "operator", "admin", "admin_deadletter"}, registry.Default.Names()...)

type natsServer struct {
	url       string
	monitor   string            // the monitoring endpoint, http://127.0.0.1:<port>
	caFile    string            // the CA of the server's certificate, for its clients
	passwords map[string]string // plain passwords, as the clients send them
	cmd       *exec.Cmd
	exited    chan struct{}
	log       *syncbuf.Buffer
}

// startNATS runs the pinned nats-server with the production configuration
// file on a free port, the passwords (bcrypt hashes, except the admins'
// plain ones) and the store directory in its environment, and stops it when t ends.
func startNATS(t *testing.T) *natsServer {
	t.Helper()
	return startNATSWith(t, natsConfPath(t), natsUsers)
}

// startNATSWith runs nats-server with the configuration file conf, whose
// users are users.
func startNATSWith(t *testing.T, conf string, users []string) *natsServer {
	t.Helper()
	passwords, secrets := map[string]string{}, map[string]string{}
	for _, u := range users {
		passwords[u] = "pw" + randomHex(t, 16)
		secrets[u] = passwords[u]
		if !strings.HasPrefix(u, "admin") {
			secrets[u] = bcryptHash(t, passwords[u])
		}
	}
	return startNATSServer(t, conf, passwords, secrets, serverTLS(t))
}

// startNATSServer runs nats-server with the configuration file conf, each
// user's secret (its password, or a bcrypt hash of it) in the server's
// environment and the server's certificate tls; clients log in with
// passwords over TLS.
func startNATSServer(t *testing.T, conf string, passwords, secrets map[string]string, tls testca.Pair) *natsServer {
	t.Helper()
	bin, err := repo.Bin("nats-server")
	if err != nil {
		t.Fatal(err)
	}
	// A port found free may be taken before the server binds it (tests in
	// other packages start servers at the same time): try others.
	for attempt := 1; ; attempt++ {
		s, taken := tryStartNATS(t, bin, conf, passwords, secrets, tls)
		if !taken {
			return s
		}
		if attempt == 5 {
			t.Fatalf("nats-server found its ports taken %d times:\n%s", attempt, s.log.String())
		}
	}
}

// tryStartNATS starts nats-server on two free ports and waits until it
// serves JetStream; taken reports that it exited because another process
// bound one of its ports first.
func tryStartNATS(t *testing.T, bin, conf string, passwords, secrets map[string]string, tls testca.Pair) (s *natsServer, taken bool) {
	t.Helper()
	port, mport := freePort(t), freePort(t)
	s = &natsServer{
		url:       fmt.Sprintf("nats://127.0.0.1:%d", port),
		monitor:   fmt.Sprintf("http://127.0.0.1:%d", mport),
		passwords: passwords,
		exited:    make(chan struct{}),
		log:       &syncbuf.Buffer{},
	}
	env := os.Environ()
	for u, secret := range secrets {
		env = append(env, "FANOUT_NATS_"+strings.ToUpper(u)+"_PASSWORD="+secret)
	}
	env = append(env, "FANOUT_NATS_STORE_DIR="+filepath.Join(t.TempDir(), "jetstream"))
	s.caFile = tls.CAFile
	env = append(env, tlsEnv(tls)...)
	s.cmd = exec.Command(bin, "-c", conf, "-p", strconv.Itoa(port), "-m", strconv.Itoa(mport))
	childproc.Tie(s.cmd)
	s.cmd.Env = env // the last of duplicate keys wins
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start nats-server: %v", err)
	}
	go func() {
		_ = s.cmd.Wait()
		close(s.exited)
	}()
	t.Cleanup(s.stop)

	// Generous waits: a login checks a bcrypt hash (cost 11 as compose
	// makes them, about 0.1 s of a free core), which takes seconds while
	// the whole suite loads both cores.
	deadline := time.Now().Add(90 * time.Second)
	for {
		nc, err := nats.Connect(s.url, nats.UserInfo("admin", s.passwords["admin"]), nats.RootCAs(s.caFile), nats.Timeout(10*time.Second))
		if err == nil {
			js, jerr := jetstream.New(nc)
			if jerr == nil {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_, jerr = js.AccountInfo(ctx)
				cancel()
			}
			nc.Close()
			if jerr == nil {
				return s, false
			}
			err = jerr
		}
		if time.Now().After(deadline) {
			t.Fatalf("nats-server on port %d not ready: %v\n%s", port, err, s.log.String())
		}
		select {
		case <-s.exited:
			if strings.Contains(s.log.String(), "address already in use") {
				return s, true
			}
			t.Fatalf("nats-server exited at start:\n%s", s.log.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// serverTLS makes a CA and a certificate for 127.0.0.1 signed by it, for
// the production configuration's TLS.
func serverTLS(t *testing.T) testca.Pair {
	t.Helper()
	p, err := testca.Server(t.TempDir())
	if err != nil {
		t.Fatalf("test CA and server certificate: %v", err)
	}
	return p
}

// tlsEnv is a server's environment for certificate p (see
// deploy/nats/cluster.conf).
func tlsEnv(p testca.Pair) []string {
	return []string{"FANOUT_NATS_TLS_CERT_FILE=" + p.CertFile, "FANOUT_NATS_TLS_KEY_FILE=" + p.KeyFile, "FANOUT_NATS_TLS_CA_FILE=" + p.CAFile}
}

func (s *natsServer) stop() {
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}

func natsConfPath(t *testing.T) string {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "deploy", "nats", "nats-server.conf")
}

// bcryptHash hashes a password as `nats server passwd` does (bcrypt, which
// nats-server checks a "$2a$" password with), at the lowest cost to keep
// the test fast.
func bcryptHash(t *testing.T, pw string) string {
	t.Helper()
	h, err := bcrypt.GenerateFromPassword([]byte(pw), bcrypt.MinCost)
	if err != nil {
		t.Fatalf("bcrypt: %v", err)
	}
	if !strings.HasPrefix(string(h), "$2a$") {
		t.Fatalf("bcrypt gave %q, not the $2a$ form nats-server reads", h)
	}
	return string(h)
}

// natsClient is one user's connection; its async errors (the server's
// permissions violations) arrive on errs.
type natsClient struct {
	user       string
	nc         *nats.Conn
	js         jetstream.JetStream
	errs       chan error
	unexpected []error
}

// connect connects as user through the production code path
// (connect.NATS with nats.user and nats.password: its inboxes are
// _INBOX_<user>), and takes over the connection's async errors.
func (s *natsServer) connect(t *testing.T, user string) *natsClient {
	t.Helper()
	c := &natsClient{user: user, errs: make(chan error, 1000)}
	cfg := connect.NATSConfig{URL: s.url, User: user, Password: s.passwords[user], CAFile: s.caFile, ConnectTimeout: 20 * time.Second}
	// A login that takes the server more than 2 s (a bcrypt check while
	// the suite loads both cores) meets the server's first PING before
	// its PONG, and nats.go gives up on the connection: try again. The
	// server's refusal of the credential is final.
	var nc *nats.Conn
	var err error
	for deadline := time.Now().Add(90 * time.Second); ; {
		nc, err = connect.NATS(cfg, "leastprivilege-"+user, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err == nil || errors.Is(err, nats.ErrAuthorization) || strings.Contains(err.Error(), "Authorization Violation") || time.Now().After(deadline) {
			break
		}
		t.Logf("connect as %s: %v; trying again", user, err)
		time.Sleep(250 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("connect as %s: %v", user, err)
	}
	t.Cleanup(nc.Close)
	nc.SetErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		select {
		case c.errs <- err:
		default:
		}
	})
	checkInboxPrefix(t, nc, user)
	c.nc = nc
	if c.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	return c
}

// waitViolation waits for the server's permissions violation for kind
// ("Publish" or "Subscription") on subject. Other async errors are kept
// for checkClean.
func (c *natsClient) waitViolation(t *testing.T, kind, subject string) {
	t.Helper()
	want := fmt.Sprintf("%s to %q", kind, subject)
	deadline := time.NewTimer(15 * time.Second)
	defer deadline.Stop()
	for {
		select {
		case err := <-c.errs:
			if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), want) {
				return
			}
			c.unexpected = append(c.unexpected, err)
		case <-deadline.C:
			t.Fatalf("%s: no permissions violation for %s within 15s: the server allowed it", c.user, want)
		}
	}
}

// deniedRequest runs op, a request on subject that the user may not make:
// the server must report the violation, and op must not succeed.
func (c *natsClient) deniedRequest(t *testing.T, subject string, op func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res := make(chan error, 1)
	go func() { res <- op(ctx) }()
	c.waitViolation(t, "Publish", subject)
	cancel() // the request has no answer coming: stop waiting for one
	if err := <-res; err == nil {
		t.Errorf("%s: request on %s succeeded", c.user, subject)
	}
}

// checkClean fails t if the server reported anything else than the
// violations the test provoked. A last denied publish serves as a marker:
// the server answers in order and the client reports errors in order, so
// once its violation arrives every earlier one has.
func (c *natsClient) checkClean(t *testing.T) {
	t.Helper()
	marker := "leastprivilege.checkpoint." + c.user
	if err := c.nc.Publish(marker, nil); err != nil {
		t.Fatal(err)
	}
	c.waitViolation(t, "Publish", marker)
	for _, err := range c.unexpected {
		t.Errorf("%s: unexpected async error: %v", c.user, err)
	}
	c.unexpected = nil
}
