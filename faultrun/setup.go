package faultrun

// A run's world set up: Postgres, the NATS servers and Redis, each behind a
// proxy the faults cut, and the search engine; the roles' environment, the
// cluster's users and passwords; then the roles.

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/faultproxy"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/redistest"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/internal/testenv/testca"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/orderstatus"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// sabotageNumberingNotSkipped is the harness's own sabotage, not the
// binary's: the outbox is left numbering every event type, and the
// checker must see the types the run expects unnumbered carry numbers.
const sabotageNumberingNotSkipped = "numbering-not-skipped"

func (r *run) setup() {
	r.startPostgres()
	r.startNATS()
	r.startRedis()
	r.connectSearch()
	r.connectAdmins()
	env := r.roleEnv()
	if r.passwords != nil {
		r.provision(env)
	}
	r.startRoles(env)
}

// startPostgres starts the run's database, with the outbox's numbering
// and the tables the run's subscribers need.
func (r *run) startPostgres() {
	t := r.t
	r.pg = pgtest.StartServer(t)
	r.db = r.pg.NewDB(t)
	if len(r.o.Unnumbered) > 0 && r.o.Sabotage != sabotageNumberingNotSkipped {
		if err := outboxstore.New(r.db.Pool).SetNumbering(context.Background(), r.o.Unnumbered); err != nil {
			t.Fatal(err)
		}
	}
	if slices.Contains(r.subscriberNames(), orderstatus.Name) {
		// A test subscriber's table: no migration makes it.
		if err := orderstatus.CreateTable(context.Background(), r.db.Pool); err != nil {
			t.Fatal(err)
		}
	}
}

// startNATS starts the nats-server (or the cluster), each node behind a
// proxy.
func (r *run) startNATS() {
	t := r.t
	if r.o.Cluster {
		r.passwords = clusterPasswords(t)
		r.tls = newClusterTLS(t)
		r.nats = startCluster(t, r.passwords, r.tls)
	} else {
		r.nats = []*natstest.Server{natstest.Start(t)}
	}
	for _, s := range r.nats {
		r.nproxy = append(r.nproxy, r.newProxy(strings.TrimPrefix(s.URL, "nats://")))
	}
}

// startRedis starts Redis. Roles and the cache reader reach it through a
// proxy, so it can be made unreachable without losing its data
// (tombstones included).
func (r *run) startRedis() {
	redisSrv := redistest.Start(r.t)
	r.rdb = redisSrv.Client(r.t)
	r.rproxy = r.newProxy(redisSrv.Addr)
}

// connectSearch makes the run's alias in the search engine, which the
// roles reach through a proxy.
func (r *run) connectSearch() {
	r.search = searchtest.Client(r.t, search.OpenSearch)
	r.alias = searchtest.Alias(r.t, r.search)
	r.sproxy = r.newProxy(strings.TrimPrefix(searchtest.URL(), "http://"))
}

// newProxy starts a proxy to addr, for the faults to cut.
func (r *run) newProxy(addr string) *faultproxy.Proxy {
	p, err := faultproxy.New(addr)
	if err != nil {
		r.t.Fatal(err)
	}
	return p
}

// connectAdmins connects the run as the streams' administrators, to the
// nodes directly: no fault cuts the checker off.
func (r *run) connectAdmins() {
	var directURLs []string
	for _, s := range r.nats {
		directURLs = append(directURLs, s.URL)
	}
	r.admin, r.js = r.adminConn(directURLs, "admin")
	r.adminDL, r.jsDL = r.admin, r.js
	if r.passwords != nil {
		r.adminDL, r.jsDL = r.adminConn(directURLs, "admin_deadletter")
	}
}

// roleEnv is every role's environment: this process's without its FANOUT_
// variables, and the run's configuration, through the proxies.
func (r *run) roleEnv() []string {
	replicas := "1"
	if r.o.Cluster {
		replicas = "3"
	}
	var urls []string
	for _, p := range r.nproxy {
		urls = append(urls, "nats://"+p.Addr)
	}
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FANOUT_") {
			env = append(env, kv)
		}
	}
	env = append(env,
		"FANOUT_POSTGRES_URL="+r.db.URL,
		"FANOUT_NATS_URL="+strings.Join(urls, ","),
		"FANOUT_REDIS_URL=redis://"+r.rproxy.Addr+"/0",
		"FANOUT_SEARCH_ENGINE=opensearch", "FANOUT_SEARCH_URL=http://"+r.sproxy.Addr, "FANOUT_SEARCH_ALIAS="+r.alias,
		"FANOUT_STREAM_REPLICAS="+replicas,
		"FANOUT_LOG_FORMAT=json", "FANOUT_LOG_LEVEL=debug", "FANOUT_HTTP_ADDR=127.0.0.1:0",
		"FANOUT_RELAY_POLL_INTERVAL=100ms", "FANOUT_RELAY_LEASE=10s", "FANOUT_RELAY_PUBLISH_TIMEOUT=5s", "FANOUT_RELAY_REAP_INTERVAL=1s",
		// Ranges of the outbox added and sealed under the faults (the
		// first 1000 ids go to outbox_default, the margin).
		"FANOUT_RELAY_PARTITION_SIZE=1000", "FANOUT_RELAY_CLEANUP_INTERVAL=2s",
		// The auditor looks every 2s (a rollback is found by the relays'
		// reconnect): the lost events are back before the drain's end.
		// Its continuous audit checks what landed 10s ago (3m by
		// default): a landing recorded after the lookback began (a batch
		// acknowledged before the rollback, recorded across a Postgres
		// outage) is the continuous audit's, and the drain waits for it.
		"FANOUT_RELAY_AUDIT_INTERVAL=2s", "FANOUT_RELAY_AUDIT_DELAY=10s",
		"FANOUT_SUBSCRIBERS_ACK_WAIT=10s", "FANOUT_SUBSCRIBERS_RETRY_MIN=200ms", "FANOUT_SUBSCRIBERS_RETRY_MAX=5s",
		"FANOUT_SUBSCRIBERS_HANDLER_TIMEOUT=8s", "FANOUT_SEARCH_TIMEOUT=5s",
	)
	if r.o.Sabotage != "" && r.o.Sabotage != sabotageNumberingNotSkipped {
		env = append(env, "FANOUT_TEST_SABOTAGE="+r.o.Sabotage)
	}
	if r.o.Atomic != "" {
		env = append(env, "FANOUT_RELAY_ATOMIC="+r.o.Atomic)
	}
	if r.wal() {
		// Slot names are cluster-wide; the run's database is its own.
		env = append(env, "FANOUT_RELAY_CAPTURE=wal", "FANOUT_RELAY_SLOT="+r.db.Name)
	}
	if r.passwords != nil {
		env = append(env, "FANOUT_NATS_CA_FILE="+r.tls.CAFile)
		// As in production: `fanout provision` as the provisioner makes
		// the streams and consumers, and every role only checks them, each
		// as its own user.
		env = append(env, "FANOUT_STREAM_PROVISION=verify", "FANOUT_SUBSCRIBERS_DEAD_LETTER_PROVISION=verify")
	}
	return env
}

// startRoles starts the relays and the subscribers (those that join late
// only prepared), seeds the shop, and waits for the consumers.
func (r *run) startRoles(env []string) {
	t := r.t
	// The relay first (it creates the stream), then the subscribers.
	specs := [][]string{{"relay-1", "relay"}, {"relay-2", "relay"}}
	for _, name := range r.subscriberNames() {
		n, ok := instances[name]
		if !ok {
			n = 2
		}
		if slices.Contains(r.o.Backfill, name) {
			r.prepareLate(env, name, n)
			continue
		}
		for i := range n {
			specs = append(specs, []string{name + "-" + strconv.Itoa(i+1), "subscribe", name})
		}
	}
	seed := func() {
		if _, err := shop.Seed(context.Background(), r.db.Pool, 150, rand.New(rand.NewPCG(r.o.Seed, 1))); err != nil {
			t.Fatal(err)
		}
	}
	if r.wal() {
		// Before any relay makes the slot: the seed is its backlog, which
		// the relay that makes it publishes by claims (by transactions
		// with relay.atomic transaction) before it streams the rest.
		seed()
	}
	for _, spec := range specs {
		role, err := newRole(spec[0], r.o.Binary, r.logDir, r.asUser(env, spec), spec[1:]...)
		if err != nil {
			t.Fatal(err)
		}
		if err := role.Start(); err != nil {
			t.Fatal(err)
		}
		r.roles = append(r.roles, role)
	}
	r.waitConsumers()
	if !r.wal() {
		seed()
	}
}

func startCluster(t *testing.T, passwords map[string]string, tls testca.Pair) []*natstest.Server {
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	// Ports found free may be taken before the nodes bind them (tests in
	// other packages start servers at the same time): try other ports.
	for range 3 {
		servers, err := tryCluster(t, root, passwords, tls)
		if err == nil {
			for _, s := range servers {
				t.Cleanup(s.Close)
			}
			return servers
		}
		for _, s := range servers {
			if s != nil {
				s.Close()
			}
		}
		if !errors.Is(err, natstest.ErrPortTaken) {
			t.Fatal(err)
		}
		t.Logf("chaos: %v; trying other ports", err)
	}
	t.Fatal("chaos: no free ports for the cluster after 3 tries")
	return nil
}

// tryCluster starts three nodes on ports found free, with the rendered
// cluster.conf: its users and their passwords, TLS for clients and
// routes, and routes that present the route password.
func tryCluster(t *testing.T, root string, passwords map[string]string, tls testca.Pair) ([]*natstest.Server, error) {
	ports := make([]int, 6)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ports[i] = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	servers := make([]*natstest.Server, 3)
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dir := t.TempDir()
			route := func(port int) string {
				return "nats://" + routeUser + ":" + passwords[routeUser] + "@127.0.0.1:" + strconv.Itoa(port)
			}
			env := []string{
				"FANOUT_NATS_NODE=n" + strconv.Itoa(i+1),
				"FANOUT_NATS_CLUSTER_PORT=" + strconv.Itoa(ports[3+i]),
				"FANOUT_NATS_ROUTE_1=" + route(ports[3]),
				"FANOUT_NATS_ROUTE_2=" + route(ports[4]),
				"FANOUT_NATS_ROUTE_3=" + route(ports[5]),
			}
			for user, pw := range passwords {
				env = append(env, "FANOUT_NATS_"+strings.ToUpper(user)+"_PASSWORD="+pw)
			}
			env = append(env, "FANOUT_NATS_TLS_CERT_FILE="+tls.CertFile, "FANOUT_NATS_TLS_KEY_FILE="+tls.KeyFile, "FANOUT_NATS_TLS_CA_FILE="+tls.CAFile)
			servers[i], errs[i] = natstest.StartServer(dir,
				natstest.WithPort(ports[i]),
				// --no_advertise: the roles know the nodes only through
				// their proxies. A node that advertised its own address
				// would let a client reconnect to it directly, around the
				// proxy, where the network faults and the store
				// rollback's cut cannot reach it.
				natstest.WithArgs("-c", filepath.Join(root, "deploy/nats/cluster.conf"), "--no_advertise=true"),
				natstest.WithEnv(env...),
				natstest.WithClientOptions(nats.UserInfo("admin", passwords["admin"]), nats.RootCAs(tls.CAFile)))
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			return servers, fmt.Errorf("cluster node %d: %w", i+1, err)
		}
	}
	return servers, nil
}

// waitConsumers waits until the stream and every subscriber's consumer exist.
func (r *run) waitConsumers() {
	r.waitRoles("the roles to come up", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		for _, name := range r.subscriberNames() {
			if slices.Contains(r.o.Backfill, name) {
				continue // it joins later
			}
			if _, err := r.js.Consumer(ctx, "EVENTS", name); err != nil {
				return false, name + ": " + err.Error()
			}
		}
		return true, ""
	})
}

// newClusterTLS makes the cluster's certificate (every node presents the
// same one, to its clients and its routes) and the CA that signed it.
func newClusterTLS(t *testing.T) testca.Pair {
	p, err := testca.Server(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// routeUser is the user every route of the cluster presents.
const routeUser = "route"

// clusterPasswords makes a password for each user of cluster.conf: fanout's
// roles, a user per subscriber, the streams' administrators, and the
// routes.
func clusterPasswords(t *testing.T) map[string]string {
	users := append([]string{"relay", "provisioner", "operator", "admin", "admin_deadletter", routeUser}, registry.Default.Names()...)
	pw := map[string]string{}
	for _, u := range users {
		b := make([]byte, 16)
		if _, err := crand.Read(b); err != nil {
			t.Fatal(err)
		}
		pw[u] = "p" + hex.EncodeToString(b) // a letter first: the server parses it as a string
	}
	return pw
}

// adminConn connects as user (a stream's administrator) to the nodes
// directly, with the user's password when the cluster authenticates.
func (r *run) adminConn(urls []string, user string) (*nats.Conn, jetstream.JetStream) {
	opts := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(200 * time.Millisecond)}
	if r.passwords != nil {
		opts = append(opts, nats.UserInfo(user, r.passwords[user]), nats.RootCAs(r.tls.CAFile))
	}
	nc, err := nats.Connect(strings.Join(urls, ","), opts...)
	if err != nil {
		r.t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		r.t.Fatal(err)
	}
	return nc, js
}

// asUser returns env for the role spec ({name, command, args...}) with the
// NATS user its command runs as, when the cluster authenticates.
func (r *run) asUser(env []string, spec []string) []string {
	if r.passwords == nil {
		return env
	}
	user := spec[1] // relay
	if spec[1] == "subscribe" || spec[1] == "backfill" {
		user = spec[2]
	}
	return append(slices.Clone(env), "FANOUT_NATS_USER="+user, "FANOUT_NATS_PASSWORD="+r.passwords[user])
}

// provision runs `fanout provision` as the provisioner until it succeeds
// (the cluster may still be electing its leader).
func (r *run) provision(env []string) {
	env = append(slices.Clone(env), "FANOUT_NATS_USER=provisioner", "FANOUT_NATS_PASSWORD="+r.passwords["provisioner"])
	deadline := time.Now().Add(90 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		cmd := exec.CommandContext(ctx, r.o.Binary, "provision")
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("fanout provision as provisioner: %v\n%s", err, out)
		}
		time.Sleep(time.Second)
	}
}
