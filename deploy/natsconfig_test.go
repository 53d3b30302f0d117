package deploy_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A wrong password, an empty one or none: each refused by the production
// configuration, as an authorization violation.
func TestNATSRefusesWrongCredentials(t *testing.T) {
	t.Parallel()
	ns := startNATS(t)
	for _, opts := range [][]nats.Option{
		{nats.UserInfo("relay", ns.passwords["invoicing"])},
		{nats.UserInfo("relay", "")},
		{},
	} {
		nc, err := nats.Connect(ns.url, append(opts, nats.RootCAs(ns.caFile), nats.Timeout(5*time.Second))...)
		if err == nil {
			nc.Close()
			t.Error("connected with wrong credentials")
		} else if !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
			t.Errorf("wrong credentials: got %v, want an authorization violation", err)
		}
	}
}

// The relay publishes and reads back; it cannot consume: no pull from any
// subscriber's consumer, no look at one, no consumer of its own, no
// subscription to the events, no dead letter, no stream deleted.
func TestTheRelayCannotConsume(t *testing.T) {
	t.Parallel()
	cfg := loadConfig(t)
	ns := startNATS(t)
	rel := ns.connect(t, "relay")
	for _, name := range registry.Default.Names() {
		rel.deniedRequest(t, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+name, func(ctx context.Context) error {
			_, err := rel.nc.RequestWithContext(ctx, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+name, []byte(`{"batch":1}`))
			return err
		})
		rel.deniedRequest(t, "$JS.API.CONSUMER.INFO.EVENTS."+name, func(ctx context.Context) error {
			_, err := rel.js.Consumer(ctx, cfg.Stream.Name, name)
			return err
		})
	}
	rel.deniedRequest(t, "$JS.API.CONSUMER.CREATE.EVENTS.snoop", func(ctx context.Context) error {
		_, err := rel.js.CreateConsumer(ctx, cfg.Stream.Name, jetstream.ConsumerConfig{Durable: "snoop", AckPolicy: jetstream.AckExplicitPolicy})
		return err
	})
	rel.deniedRequest(t, "$JS.API.STREAM.DELETE.EVENTS", func(ctx context.Context) error {
		return rel.js.DeleteStream(ctx, cfg.Stream.Name)
	})
	sub, err := rel.nc.Subscribe("events.>", func(*nats.Msg) {})
	if err != nil {
		t.Fatal(err)
	}
	rel.waitViolation(t, "Subscription", "events.>")
	_ = sub.Unsubscribe()
	if err := rel.nc.Publish("deadletter.invoicing.x", nil); err != nil {
		t.Fatal(err)
	}
	rel.waitViolation(t, "Publish", "deadletter.invoicing.x")
	rel.checkClean(t)
}

// TestNATSConfigNeedsItsSecrets: the configuration names its secrets only by
// environment variable, and the server refuses to start without them.
func TestNATSConfigNeedsItsSecrets(t *testing.T) {
	t.Parallel()
	bin, err := repo.Bin("nats-server")
	if err != nil {
		t.Fatal(err)
	}
	conf := natsConfPath(t)
	body, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	tls := serverTLS(t)
	values := map[string]string{"FANOUT_NATS_TLS_CERT_FILE": tls.CertFile, "FANOUT_NATS_TLS_KEY_FILE": tls.KeyFile}
	vars := []string{"FANOUT_NATS_STORE_DIR", "FANOUT_NATS_TLS_CERT_FILE", "FANOUT_NATS_TLS_KEY_FILE"}
	value := func(v string) string {
		if f, ok := values[v]; ok {
			return f
		}
		return "x" + v
	}
	for _, u := range natsUsers {
		v := "FANOUT_NATS_" + strings.ToUpper(u) + "_PASSWORD"
		vars = append(vars, v)
		if !strings.Contains(string(body), "password: $"+v) {
			t.Errorf("%s does not take user %s's password from $%s", conf, u, v)
		}
	}
	var base []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FANOUT_NATS_") {
			base = append(base, kv)
		}
	}
	check := func(env []string) (string, error) {
		cmd := exec.Command(bin, "-c", conf, "-t")
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	all := append([]string(nil), base...)
	for _, v := range vars {
		all = append(all, v+"="+value(v))
	}
	if out, err := check(all); err != nil {
		t.Fatalf("nats-server -t with every variable set: %v\n%s", err, out)
	}
	for i, missing := range vars {
		env := append([]string(nil), base...)
		for j, v := range vars {
			if j != i {
				env = append(env, v+"="+value(v))
			}
		}
		out, err := check(env)
		if err == nil || !strings.Contains(out, missing) {
			t.Errorf("nats-server -t without %s: %v, %q; want a refusal naming it", missing, err, out)
		}
	}
}
