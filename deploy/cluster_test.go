package deploy_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/childproc"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/fanout/fanout/internal/testenv/testca"
	"github.com/nats-io/nats.go"
)

// The cluster configuration's routes authenticate, over TLS: nodes whose
// routes present no credentials, or a wrong password, are refused by each
// other and form no cluster; with the route password the three form one;
// a node whose certificate another CA signed is refused, password or not.
func TestClusterRoutesAuthenticate(t *testing.T) {
	t.Parallel()
	bin, err := repo.Bin("nats-server")
	if err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(filepath.Dir(natsConfPath(t)), "cluster.conf")
	passwords := map[string]string{"route": "p" + randomHex(t, 16)}
	for _, u := range natsUsers {
		passwords[u] = "p" + randomHex(t, 16)
	}
	type node struct {
		cmd    *exec.Cmd
		log    *syncbuf.Buffer
		port   int
		caFile string
		exited chan struct{}
	}
	ours := serverTLS(t)
	certs := []testca.Pair{ours, ours, ours}
	stop := func(nodes []*node) {
		for _, n := range nodes {
			_ = n.cmd.Process.Signal(syscall.SIGTERM)
			<-n.exited
		}
	}
	// start starts the three nodes on fresh ports, each with its
	// certificate from certs and soliciting routes to all with the
	// credentials creds ("user:password@" or ""), and reports whether one
	// found a port taken (tests in other packages start servers at the
	// same time) once each is ready or gone.
	start := func(creds string, certs []testca.Pair) (nodes []*node, taken bool) {
		t.Helper()
		routePorts := []int{freePort(t), freePort(t), freePort(t)}
		for i := range 3 {
			env := append(os.Environ(), "FANOUT_NATS_NODE=n"+strconv.Itoa(i+1), "FANOUT_NATS_CLUSTER_PORT="+strconv.Itoa(routePorts[i]),
				"FANOUT_NATS_ROUTE_PASSWORD="+passwords["route"])
			env = append(env, tlsEnv(certs[i])...)
			for j, p := range routePorts {
				env = append(env, fmt.Sprintf("FANOUT_NATS_ROUTE_%d=nats://%s127.0.0.1:%d", j+1, creds, p))
			}
			for u, pw := range passwords {
				env = append(env, "FANOUT_NATS_"+strings.ToUpper(u)+"_PASSWORD="+pw)
			}
			n := &node{log: &syncbuf.Buffer{}, port: freePort(t), caFile: certs[i].CAFile, exited: make(chan struct{})}
			n.cmd = exec.Command(bin, "-c", conf, "-a", "127.0.0.1", "-p", strconv.Itoa(n.port),
				"-js", "-sd", filepath.Join(t.TempDir(), "jetstream"))
			childproc.Tie(n.cmd)
			n.cmd.Env = env
			n.cmd.Stdout, n.cmd.Stderr = n.log, n.log
			if err := n.cmd.Start(); err != nil {
				t.Fatal(err)
			}
			go func() { _ = n.cmd.Wait(); close(n.exited) }()
			t.Cleanup(func() { _ = n.cmd.Process.Kill(); <-n.exited })
			nodes = append(nodes, n)
		}
		for _, n := range nodes {
			waitFor(t, "a node to be ready or gone", func() bool {
				select {
				case <-n.exited:
					taken = taken || strings.Contains(n.log.String(), "address already in use")
					return true
				default:
					return strings.Contains(n.log.String(), "Server is ready")
				}
			})
		}
		return nodes, taken
	}
	cluster := func(creds string, certs []testca.Pair) []*node {
		t.Helper()
		for range 5 {
			nodes, taken := start(creds, certs)
			if !taken {
				return nodes
			}
			stop(nodes)
		}
		t.Fatal("the cluster's nodes found their ports taken 5 times")
		return nil
	}
	// crosses reports whether a message published on node from reaches a
	// subscriber on node to (the same account, EVENTS, as admin): only a
	// route carries it.
	crosses := func(from, to *node, within time.Duration) bool {
		t.Helper()
		conn := func(n *node) *nats.Conn {
			// A loaded CI host once took longer than waitFor's 20 s here
			// and said nothing more; wait longer and say why it failed.
			var lastErr error
			deadline := time.Now().Add(60 * time.Second)
			for time.Now().Before(deadline) {
				nc, err := nats.Connect("nats://127.0.0.1:"+strconv.Itoa(n.port),
					nats.UserInfo("admin", passwords["admin"]), nats.RootCAs(n.caFile), nats.Timeout(5*time.Second))
				if err == nil {
					return nc
				}
				lastErr = err
				select {
				case <-n.exited:
					t.Fatalf("the node on port %d exited:\n%s", n.port, n.log.String())
				case <-time.After(100 * time.Millisecond):
				}
			}
			t.Fatalf("no client connection to the node on port %d in 60 s (last error: %v); its log:\n%s", n.port, lastErr, n.log.String())
			return nil
		}
		pub, sub := conn(from), conn(to)
		defer pub.Close()
		defer sub.Close()
		got, err := sub.SubscribeSync("cluster.probe")
		if err != nil {
			t.Fatal(err)
		}
		if err := sub.Flush(); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(within)
		for time.Now().Before(deadline) {
			if err := pub.Publish("cluster.probe", nil); err != nil {
				t.Fatal(err)
			}
			if _, err := got.NextMsg(100 * time.Millisecond); err == nil {
				return true
			}
		}
		return false
	}
	for _, creds := range []string{"", "route:wrong" + passwords["route"] + "@"} {
		nodes := cluster(creds, certs)
		// Each node refuses the others' routes, naming the violation.
		waitFor(t, "every node to refuse a route", func() bool {
			for _, n := range nodes {
				if !strings.Contains(n.log.String(), "Authorization Violation") {
					return false
				}
			}
			return true
		})
		if crosses(nodes[0], nodes[1], 2*time.Second) {
			t.Errorf("routes presenting %q: a message crossed from node 1 to node 2", creds)
		}
		stop(nodes)
	}

	// A node with the route password and a certificate of another CA:
	// the others refuse its routes, and it theirs.
	nodes := cluster("route:"+passwords["route"]+"@", []testca.Pair{ours, ours, serverTLS(t)})
	waitFor(t, "node 3 to refuse the others' certificates", func() bool {
		return strings.Contains(nodes[2].log.String(), "certificate signed by unknown authority")
	})
	if crosses(nodes[0], nodes[2], 2*time.Second) || crosses(nodes[2], nodes[1], 2*time.Second) {
		t.Error("a node whose certificate another CA signed: a message crossed its routes")
	}
	if !crosses(nodes[0], nodes[1], 20*time.Second) {
		t.Error("nodes 1 and 2, with the route password and the CA's certificates, form no cluster")
	}
	stop(nodes)

	nodes = cluster("route:"+passwords["route"]+"@", certs)
	if !crosses(nodes[0], nodes[1], 20*time.Second) || !crosses(nodes[2], nodes[0], 20*time.Second) {
		t.Error("with the route password, messages do not cross between the nodes")
	}
	for i, n := range nodes {
		if strings.Contains(n.log.String(), "Authorization Violation") {
			t.Errorf("node %d refused a route with the route password:\n%s", i+1, n.log.String())
		}
	}
	stop(nodes)
}
