package deploy_test

// The red-team suite: the attacks on the shipped NATS configuration that
// its layout refuses, each made as the identity that would make it. A
// refusal is judged by its outcome, read from the server's own monitoring
// endpoint (what each stream holds, in every account): the attack changed
// nothing. TestNATSPermissions holds the refusals of single API calls.
//
// FANOUT_REDTEAM_NATS_CONF runs the suite against another configuration
// file (the one before the accounts, say), to see each attack succeed.

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func TestRedTeamNATS(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := loadConfig(t)
	ns, _ := startRedTeamNATS(t)
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	rel, prov, op := ns.connect(t, "relay"), ns.connect(t, "provisioner"), ns.connect(t, "operator")
	inv, cin := ns.connect(t, invoicing.Name), ns.connect(t, cacheinval.Name)
	admin := ns.connect(t, "admin")

	// The streams, as `fanout provision` makes them; the consumers come
	// after the first attack, which needs one not made yet.
	if err := stream.Ensure(ctx, prov.js, cfg.Stream, relay.RepublishDelay(cfg.Relay), discard); err != nil {
		t.Fatalf("provision the stream: %v", err)
	}
	if _, err := subscribers.ProvisionDeadLetterStream(ctx, prov.js, cfg.Subscribers, cfg.Stream.Replicas, stream.Changes{}, discard); err != nil {
		t.Fatalf("provision the dead-letter stream: %v", err)
	}
	for i, typ := range []string{shop.OrderCreated, "product.updated"} {
		msg := nats.NewMsg("events." + typ)
		msg.Data = []byte(`{"order_id": 1, "product_id": 1}`)
		msg.Header.Set(wire.EventIDHeader, strconv.Itoa(i+1))
		if _, err := rel.js.PublishMsg(ctx, msg, jetstream.WithMsgID(strconv.Itoa(i+1))); err != nil {
			t.Fatalf("relay publishes: %v", err)
		}
	}
	want := map[string]uint64{cfg.Stream.Name: 2, cfg.Subscribers.DeadLetterStream: 0}
	held := func(t *testing.T, attack string) {
		t.Helper()
		got := streamMessages(t, ns)
		for name, n := range want {
			if got[name] != n {
				t.Errorf("%s: stream %s holds %d messages, want %d: the attack got through", attack, name, got[name], n)
			}
		}
	}
	held(t, "setup")
	// heldThrough is held, checked for a second: a pulled message and a
	// stored response arrive after the request's own answer.
	heldThrough := func(t *testing.T, attack string) {
		t.Helper()
		for range 10 {
			held(t, attack)
			if t.Failed() {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	t.Run("the provisioner reads no event through a push consumer", func(t *testing.T) {
		// It may create a subscriber's consumer: as one that pushes the
		// events to its own inbox, and another that pushes them into the
		// dead letters under invoicing's name.
		snooped := make(chan *nats.Msg, 10)
		sub, err := prov.nc.ChanSubscribe("_INBOX_provisioner.snoop", snooped)
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Unsubscribe() //nolint:errcheck
		for name, deliver := range map[string]string{invoicing.Name: "_INBOX_provisioner.snoop", cacheinval.Name: "deadletter.invoicing." + shop.OrderCreated} {
			_, err := prov.js.CreateConsumer(ctx, cfg.Stream.Name, jetstream.ConsumerConfig{Durable: name, DeliverSubject: deliver, AckPolicy: jetstream.AckNonePolicy})
			if err != nil {
				t.Fatalf("the provisioner creates consumer %s (a name it may create): %v", name, err)
			}
		}
		// A push consumer with no one listening where it delivers stays
		// put; one with a listener has delivered within this wait.
		select {
		case m := <-snooped:
			t.Errorf("the provisioner read event %s through a push consumer", m.Subject)
		case <-time.After(2 * time.Second):
		}
		held(t, "a push consumer delivering into the dead letters")
		for _, name := range []string{invoicing.Name, cacheinval.Name} {
			if err := admin.js.DeleteConsumer(ctx, cfg.Stream.Name, name); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("the relay's audit consumer feeds no stream", func(t *testing.T) {
		// Its audit consumers, created by the relay as push consumers,
		// would deliver into the dead letters under invoicing's name, and
		// into EVENTS itself (each message stored again). Only the
		// provisioner creates them (TestRedTeamReaderConsumers has the
		// attacks through the JetStream API).
		for _, push := range [][2]string{{stream.AuditConsumer, "deadletter.invoicing." + shop.OrderCreated}, {stream.AuditCommandConsumer, "events." + shop.OrderCreated}} {
			name, deliver := push[0], push[1]
			cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			_, err := rel.js.CreateConsumer(cctx, cfg.Stream.Name, jetstream.ConsumerConfig{Name: name, DeliverSubject: deliver, AckPolicy: jetstream.AckNonePolicy})
			cancel()
			t.Logf("the relay creates its consumer %s pushing to %s: %v", name, deliver, err)
		}
		heldThrough(t, "the relay's audit consumer pushing into a stream")
		for _, name := range []string{stream.AuditConsumer, stream.AuditCommandConsumer} {
			if err := admin.js.DeleteConsumer(ctx, cfg.Stream.Name, name); err == nil {
				t.Errorf("the relay created its consumer %s", name)
			} else if !errors.Is(err, jetstream.ErrConsumerNotFound) {
				t.Fatal(err)
			}
		}
		if !t.Failed() {
			rel.waitViolation(t, "Publish", "$JS.API.CONSUMER.CREATE."+cfg.Stream.Name+"."+stream.AuditConsumer)
			rel.waitViolation(t, "Publish", "$JS.API.CONSUMER.CREATE."+cfg.Stream.Name+"."+stream.AuditCommandConsumer)
		}
	})

	events, err := prov.js.Stream(ctx, cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range registry.Default.All() {
		if _, err := subscribers.ProvisionConsumer(ctx, events, d, cfg.Subscribers, cfg.Stream); err != nil {
			t.Fatalf("provision consumer %s: %v", d.Name, err)
		}
	}

	t.Run("no reply subject delivers into a stream", func(t *testing.T) {
		// settle makes c's earlier requests answered: the server answers
		// a connection's API requests in order.
		settle := func(c *natsClient) {
			t.Helper()
			if _, err := c.js.Stream(ctx, cfg.Stream.Name); err != nil {
				t.Fatalf("%s looks up the stream: %v", c.user, err)
			}
		}
		for _, reply := range []string{"events." + shop.OrderCreated, "deadletter.invoicing." + shop.OrderCreated} {
			// An API response.
			if err := cin.nc.PublishRequest("$JS.API.STREAM.INFO."+cfg.Stream.Name, reply, nil); err != nil {
				t.Fatal(err)
			}
			settle(cin)
			heldThrough(t, "a stream info response sent to "+reply)

			// A pulled message: the event, stored again.
			if err := cin.nc.PublishRequest("$JS.API.CONSUMER.MSG.NEXT."+cfg.Stream.Name+"."+cacheinval.Name, reply, []byte(`{"batch":1,"no_wait":true}`)); err != nil {
				t.Fatal(err)
			}
			settle(cin)
			heldThrough(t, "a pull whose reply is "+reply)

			// A PubAck.
			m := nats.NewMsg("events.product.updated")
			m.Reply = reply
			m.Data = []byte(`{"product_id": 2}`)
			m.Header.Set(jetstream.MsgIDHeader, "1") // a duplicate: stored nowhere, acked all the same
			if err := rel.nc.PublishMsg(m); err != nil {
				t.Fatal(err)
			}
			settle(rel)
			heldThrough(t, "a publish whose reply is "+reply)
		}
		rel.checkClean(t)
		cin.checkClean(t)
	})

	t.Run("the operator cannot rewrite a subscriber's consumer", func(t *testing.T) {
		before, err := admin.js.Consumer(ctx, cfg.Stream.Name, invoicing.Name)
		if err != nil {
			t.Fatal(err)
		}
		cc := before.CachedInfo().Config
		cc.MaxDeliver = 1
		subject := "$JS.API.CONSUMER.CREATE." + cfg.Stream.Name + "." + invoicing.Name // filters in the body
		op.deniedRequest(t, subject, func(ctx context.Context) error {
			_, err := op.js.UpdateConsumer(ctx, cfg.Stream.Name, cc)
			return err
		})
		after, err := admin.js.Consumer(ctx, cfg.Stream.Name, invoicing.Name)
		if err != nil {
			t.Fatal(err)
		}
		if ds := stream.ConsumerDifferences(after.CachedInfo().Config, before.CachedInfo().Config); len(ds) > 0 {
			t.Errorf("invoicing's consumer changed: %s", stream.Join(ds))
		}
		op.checkClean(t)
	})

	t.Run("the provisioner cannot purge by an update", func(t *testing.T) {
		for _, sc := range []jetstream.StreamConfig{stream.JetStreamConfig(cfg.Stream), subscribers.DeadLetterStreamConfig(cfg.Subscribers, cfg.Stream.Replicas)} {
			sc.MaxMsgs = 1
			prov.deniedRequest(t, "$JS.API.STREAM.UPDATE."+sc.Name, func(ctx context.Context) error {
				_, err := prov.js.UpdateStream(ctx, sc)
				return err
			})
		}
		held(t, "a stream update to max_msgs 1")
		prov.checkClean(t)
	})

	t.Run("a subscriber pulls only its own consumer and acks only its own messages", func(t *testing.T) {
		inv.deniedRequest(t, "$JS.API.CONSUMER.MSG.NEXT."+cfg.Stream.Name+"."+cacheinval.Name, func(ctx context.Context) error {
			_, err := inv.nc.RequestWithContext(ctx, "$JS.API.CONSUMER.MSG.NEXT."+cfg.Stream.Name+"."+cacheinval.Name, []byte(`{"batch":1}`))
			return err
		})
		ack := "$JS.ACK." + cfg.Stream.Name + "." + cacheinval.Name + ".1.2.2.0.0"
		if err := inv.nc.Publish(ack, []byte("+TERM")); err != nil {
			t.Fatal(err)
		}
		inv.waitViolation(t, "Publish", ack)
		inv.checkClean(t)
	})
}

// streamMessages reads, from the server's monitoring endpoint, how many
// messages each stream holds, whatever account it is in.
// startRedTeamNATS starts nats-server with the shipped configuration, or
// with FANOUT_REDTEAM_NATS_CONF's (to see attacks succeed against
// another); shipped says which.
func startRedTeamNATS(t *testing.T) (ns *natsServer, shipped bool) {
	t.Helper()
	if conf := os.Getenv("FANOUT_REDTEAM_NATS_CONF"); conf != "" {
		return startNATSWith(t, conf, natsUsers), false
	}
	return startNATSWith(t, natsConfPath(t), natsUsers), true
}

func streamMessages(t *testing.T, ns *natsServer) map[string]uint64 {
	t.Helper()
	resp, err := http.Get(ns.monitor + "/jsz?accounts=true&streams=true")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var jsz struct {
		Accounts []struct {
			Name    string `json:"name"`
			Streams []struct {
				Name  string `json:"name"`
				State struct {
					Msgs uint64 `json:"messages"`
				} `json:"state"`
			} `json:"stream_detail"`
		} `json:"account_details"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&jsz); err != nil {
		t.Fatal(err)
	}
	got := map[string]uint64{}
	for _, a := range jsz.Accounts {
		for _, s := range a.Streams {
			if _, dup := got[s.Name]; dup {
				t.Fatalf("two streams named %s", s.Name)
			}
			got[s.Name] = s.State.Msgs
		}
	}
	return got
}
