package main

// The production NATS layout's cost (part accounts): the relay draining
// -rows rows as user relay, whose account reaches stream EVENTS through a
// service import (deploy/nats/nats-server.conf), against the same relay
// connected inside the stream's own account (user admin), on one server
// running that file; and raw async publishes the same two ways.

import (
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
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func benchAccounts(ctx context.Context) error {
	srv, err := startProductionNATS()
	if err != nil {
		return err
	}
	defer srv.stop()
	conn := func(user string) (*nats.Conn, error) {
		return connect.NATS(connect.NATSConfig{URL: srv.url, User: user, Password: srv.passwords[user], ConnectTimeout: 5 * time.Second}, "bench-"+user, quiet)
	}
	viaImport, err := conn("relay")
	if err != nil {
		return err
	}
	defer viaImport.Close()
	inAccount, err := conn("admin")
	if err != nil {
		return err
	}
	defer inAccount.Close()
	adminJS, err := jetstream.New(inAccount)
	if err != nil {
		return err
	}
	streamCfg := stream.DefaultConfig()
	streamCfg.Provision = "verify" // as in production: the relay only checks it
	// fresh gives each run an empty stream EVENTS (the only name the
	// configuration lets the relay publish to).
	fresh := func() error {
		if err := adminJS.DeleteStream(ctx, streamCfg.Name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return err
		}
		_, err := adminJS.CreateStream(ctx, stream.JetStreamConfig(streamCfg))
		return err
	}
	drain := func(nc *nats.Conn) (float64, error) {
		if err := fresh(); err != nil {
			return 0, err
		}
		env, err := newRelayEnv(ctx, nc, &streamCfg)
		if err != nil {
			return 0, err
		}
		defer env.close()
		res, err := env.drain(ctx, relayConfig())
		return res.rate, err
	}
	raw := func(nc *nats.Conn) (float64, error) {
		if err := fresh(); err != nil {
			return 0, err
		}
		js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(relay.DefaultConfig().MaxInFlight))
		if err != nil {
			return 0, err
		}
		payload := make([]byte, 200)
		start := time.Now()
		for i := range *rows {
			m := nats.NewMsg(streamCfg.SubjectPrefix + ".product.updated")
			m.Data = payload
			if _, err := js.PublishMsgAsync(m, jetstream.WithMsgID(strconv.Itoa(i+1))); err != nil {
				return 0, err
			}
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(2 * time.Minute):
			return 0, fmt.Errorf("raw publish: PubAcks missing after 2 minutes")
		}
		return float64(*rows) / time.Since(start).Seconds(), nil
	}
	var drainImport, drainIn, rawImport, rawIn, drainRatio, rawRatio benchkit.Figure
	for run := range *benchkit.Runs {
		// Alternating, in one sitting.
		di, err := drain(viaImport)
		if err != nil {
			return fmt.Errorf("drain as relay: %w", err)
		}
		da, err := drain(inAccount)
		if err != nil {
			return fmt.Errorf("drain in the stream's account: %w", err)
		}
		ri, err := raw(viaImport)
		if err != nil {
			return fmt.Errorf("raw as relay: %w", err)
		}
		ra, err := raw(inAccount)
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

// productionNATS is nats-server running the rendered production
// configuration, with a password of its own for every user.
type productionNATS struct {
	url       string
	passwords map[string]string
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
	env := append(os.Environ(), "FANOUT_NATS_STORE_DIR="+filepath.Join(dir, "jetstream"))
	for _, u := range append([]string{"relay", "provisioner", "operator", "admin", "admin_deadletter"}, registry.Default.Names()...) {
		b := make([]byte, 12)
		_, _ = rand.Read(b)
		s.passwords[u] = "p" + hex.EncodeToString(b)
		env = append(env, "FANOUT_NATS_"+strings.ToUpper(u)+"_PASSWORD="+s.passwords[u])
	}
	port := 14000 + int(time.Now().UnixNano()%1000)
	s.url = "nats://127.0.0.1:" + strconv.Itoa(port)
	s.cmd = exec.Command(bin, "-c", filepath.Join(root, "deploy", "nats", "nats-server.conf"), "-p", strconv.Itoa(port))
	s.cmd.Env = env
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		nc, err := nats.Connect(s.url, nats.UserInfo("admin", s.passwords["admin"]))
		if err == nil {
			nc.Close()
			return s, nil
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("nats-server with the production configuration on %s: %w", s.url, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (s *productionNATS) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	_ = s.cmd.Wait()
	_ = os.RemoveAll(s.dir)
}
