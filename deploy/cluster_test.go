package deploy_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
)

// The cluster configuration's routes authenticate: nodes whose routes
// present no credentials, or a wrong password, are refused by each other
// and form no cluster; with the route password the three form one.
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
	routePorts := []int{freePort(t), freePort(t), freePort(t)}
	type node struct {
		cmd     *exec.Cmd
		log     *syncbuf.Buffer
		monitor int
	}
	// cluster starts the three nodes, each soliciting routes to all with
	// the credentials creds ("user:password@" or "").
	cluster := func(creds string) []*node {
		t.Helper()
		var nodes []*node
		for i := range 3 {
			env := append(os.Environ(), "FANOUT_NATS_NODE=n"+strconv.Itoa(i+1), "FANOUT_NATS_CLUSTER_PORT="+strconv.Itoa(routePorts[i]),
				"FANOUT_NATS_ROUTE_PASSWORD="+passwords["route"])
			for j, p := range routePorts {
				env = append(env, fmt.Sprintf("FANOUT_NATS_ROUTE_%d=nats://%s127.0.0.1:%d", j+1, creds, p))
			}
			for u, pw := range passwords {
				env = append(env, "FANOUT_NATS_"+strings.ToUpper(u)+"_PASSWORD="+pw)
			}
			n := &node{log: &syncbuf.Buffer{}, monitor: freePort(t)}
			n.cmd = exec.Command(bin, "-c", conf, "-a", "127.0.0.1", "-p", strconv.Itoa(freePort(t)), "-m", strconv.Itoa(n.monitor),
				"-js", "-sd", filepath.Join(t.TempDir(), "jetstream"))
			n.cmd.Env = env
			n.cmd.Stdout, n.cmd.Stderr = n.log, n.log
			if err := n.cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = n.cmd.Process.Kill(); _ = n.cmd.Wait() })
			nodes = append(nodes, n)
		}
		return nodes
	}
	routes := func(n *node) int {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/routez", n.monitor))
		if err != nil {
			return -1 // not up yet
		}
		defer resp.Body.Close()
		var rz struct {
			NumRoutes int `json:"num_routes"`
		}
		if json.NewDecoder(resp.Body).Decode(&rz) != nil {
			return -1
		}
		return rz.NumRoutes
	}
	stop := func(nodes []*node) {
		for _, n := range nodes {
			_ = n.cmd.Process.Signal(syscall.SIGTERM)
			_ = n.cmd.Wait()
		}
	}

	for _, creds := range []string{"", "route:wrong" + passwords["route"] + "@"} {
		nodes := cluster(creds)
		// Each node refuses the others' routes, naming the violation.
		waitFor(t, "every node to refuse a route", func() bool {
			for _, n := range nodes {
				if !strings.Contains(n.log.String(), "Authorization Violation") {
					return false
				}
			}
			return true
		})
		for i, n := range nodes {
			if r := routes(n); r != 0 {
				t.Errorf("routes presenting %q: node %d has %d routes", creds, i+1, r)
			}
		}
		stop(nodes)
	}

	nodes := cluster("route:" + passwords["route"] + "@")
	waitFor(t, "the three nodes to route to each other", func() bool {
		for _, n := range nodes {
			if routes(n) < 2 {
				return false
			}
		}
		return true
	})
	for i, n := range nodes {
		if strings.Contains(n.log.String(), "Authorization Violation") {
			t.Errorf("node %d refused a route with the route password:\n%s", i+1, n.log.String())
		}
	}
	stop(nodes)
}
