package main

// The production NATS layout's cost (part accounts): the relay draining
// -rows rows as user relay, whose account reaches stream EVENTS through a
// service import (deploy/nats/nats-server.conf), against the same relay
// connected inside the stream's own account (user admin), on one server
// running that file; and raw async publishes the same two ways.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/internal/testenv/testca"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// accountsBench is the production layout's server, with a connection
// through the service import (user relay) and one inside the stream's own
// account (user admin), and the stream the relay publishes to there.
type accountsBench struct {
	viaImport, inAccount *nats.Conn
	admin                jetstream.JetStream // of inAccount
	stream               stream.Config
}

// benchAccounts runs on a server of its own, not nc's.
func benchAccounts(ctx context.Context, _ *nats.Conn) error {
	srv, err := startProductionNATS()
	if err != nil {
		return err
	}
	defer srv.stop()
	b := &accountsBench{stream: stream.DefaultConfig()}
	b.stream.Provision = "verify" // as in production: the relay only checks it
	if b.viaImport, err = srv.connect("relay"); err != nil {
		return err
	}
	defer b.viaImport.Close()
	if b.inAccount, err = srv.connect("admin"); err != nil {
		return err
	}
	defer b.inAccount.Close()
	if b.admin, err = jetstream.New(b.inAccount); err != nil {
		return err
	}
	var drainImport, drainIn, rawImport, rawIn, drainRatio, rawRatio benchkit.Figure
	for run := range *benchkit.Runs {
		// Alternating, in one sitting.
		di, err := b.drain(ctx, b.viaImport)
		if err != nil {
			return fmt.Errorf("drain as relay: %w", err)
		}
		da, err := b.drain(ctx, b.inAccount)
		if err != nil {
			return fmt.Errorf("drain in the stream's account: %w", err)
		}
		ri, err := b.raw(ctx, b.viaImport)
		if err != nil {
			return fmt.Errorf("raw as relay: %w", err)
		}
		ra, err := b.raw(ctx, b.inAccount)
		if err != nil {
			return fmt.Errorf("raw in the stream's account: %w", err)
		}
		drainImport.Add(di)
		drainIn.Add(da)
		rawImport.Add(ri)
		rawIn.Add(ra)
		drainRatio.Add(di / da)
		rawRatio.Add(ri / ra)
		fmt.Printf("    run %d of %d: drain %.0f rows/s through the import, %.0f in the stream's account; raw %.0f / %.0f msgs/s\n", run+1, *benchkit.Runs, di, da, ri, ra)
	}
	fmt.Printf("(accounts) deploy/nats/nats-server.conf, %d rows: the poll relay as user relay (service import) %s, in the stream's account %s: %s\n",
		*rows, drainImport.Format("%.0f rows/s"), drainIn.Format("%.0f rows/s"), drainRatio.Format("%.2f"))
	fmt.Printf("           raw JetStream async publish through the import %s, in the account %s: %s\n\n",
		rawImport.Format("%.0f msgs/s"), rawIn.Format("%.0f msgs/s"), rawRatio.Format("%.2f"))
	return nil
}

// fresh gives each run an empty stream EVENTS (the only name the
// configuration lets the relay publish to).
func (b *accountsBench) fresh(ctx context.Context) error {
	if err := b.admin.DeleteStream(ctx, b.stream.Name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return err
	}
	_, err := b.admin.CreateStream(ctx, stream.JetStreamConfig(b.stream))
	return err
}

// drain is part a's drain by a relay connected with nc, in rows/s.
func (b *accountsBench) drain(ctx context.Context, nc *nats.Conn) (float64, error) {
	if err := b.fresh(ctx); err != nil {
		return 0, err
	}
	env, err := newRelayEnv(ctx, nc, &b.stream)
	if err != nil {
		return 0, err
	}
	defer env.close()
	res, err := env.drain(ctx, relayConfig())
	return res.rate, err
}

// raw is -rows raw async publishes of 200 bytes on nc, in msgs/s.
func (b *accountsBench) raw(ctx context.Context, nc *nats.Conn) (float64, error) {
	if err := b.fresh(ctx); err != nil {
		return 0, err
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(relay.DefaultConfig().MaxInFlight))
	if err != nil {
		return 0, err
	}
	payload := make([]byte, 200)
	start := time.Now()
	err = publishAll(js, *rows, func(i int) (*nats.Msg, error) {
		m := nats.NewMsg(b.stream.SubjectPrefix + ".product.updated")
		m.Data = payload
		m.Header.Set(jetstream.MsgIDHeader, strconv.Itoa(i+1))
		return m, nil
	})
	return float64(*rows) / time.Since(start).Seconds(), err
}

// productionNATS is nats-server running the rendered production
// configuration, with a password of its own for every user.
type productionNATS struct {
	url       string
	passwords map[string]string
	caFile    string // the configuration asks for TLS: a CA of the bench's own
	cmd       *exec.Cmd
	dir       string
}

func startProductionNATS() (*productionNATS, error) {
	root, err := repo.Root()
	if err != nil {
		return nil, err
	}
	bin, err := repo.Bin("nats-server")
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "fanout-bench-nats-")
	if err != nil {
		return nil, err
	}
	s := &productionNATS{passwords: map[string]string{}, dir: dir}
	cert, err := testca.Server(dir)
	if err != nil {
		return nil, err
	}
	s.caFile = cert.CAFile
	env := append(os.Environ(), "FANOUT_NATS_STORE_DIR="+filepath.Join(dir, "jetstream"),
		"FANOUT_NATS_TLS_CERT_FILE="+cert.CertFile, "FANOUT_NATS_TLS_KEY_FILE="+cert.KeyFile)
	for _, u := range append([]string{"relay", "provisioner", "operator", "admin", "admin_deadletter"}, registry.Default.Names()...) {
		b := make([]byte, 12)
		_, _ = rand.Read(b)
		s.passwords[u] = "p" + hex.EncodeToString(b)
		env = append(env, "FANOUT_NATS_"+strings.ToUpper(u)+"_PASSWORD="+s.passwords[u])
	}
	port := 14000 + int(time.Now().UnixNano()%1000)
	s.url = "nats://127.0.0.1:" + strconv.Itoa(port)
	// Its own monitoring port: the file's, 8222, is the development
	// server's too.
	s.cmd = exec.Command(bin, "-c", filepath.Join(root, "deploy", "nats", "nats-server.conf"), "-p", strconv.Itoa(port), "-m", strconv.Itoa(port+1000))
	s.cmd.Env = env
	var log bytes.Buffer
	s.cmd.Stdout, s.cmd.Stderr = &log, &log
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		nc, err := nats.Connect(s.url, nats.UserInfo("admin", s.passwords["admin"]), nats.RootCAs(s.caFile))
		if err == nil {
			nc.Close()
			return s, nil
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("nats-server with the production configuration on %s: %w\n%s", s.url, err, log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// connect connects to the server as user.
func (s *productionNATS) connect(user string) (*nats.Conn, error) {
	return connect.NATS(connect.NATSConfig{URL: s.url, User: user, Password: s.passwords[user], CAFile: s.caFile, ConnectTimeout: 5 * time.Second}, "bench-"+user, quiet)
}

func (s *productionNATS) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	_ = s.cmd.Wait()
	_ = os.RemoveAll(s.dir)
}
