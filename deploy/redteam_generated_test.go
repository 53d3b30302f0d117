package deploy_test

// The generated red-team suite. Its targets are not a list of the attacks
// someone thought of: they are the server's own subject space for the
// objects fanout runs on, every JetStream API call on each of its
// consumers and streams, each consumer's acks, and each stream's subjects.
// Every identity tries each target in three forms, with bodies an attacker
// chooses: as a publish (a request, answered into its own inbox), as the
// reply subject of a request the identity may make (the server's answer,
// or a message pulled from its own consumer, is then delivered there),
// and as the delivery subject of a push consumer it asks the server to
// make. Judged by the outcome, read as an administrator: no other role's
// consumer moved or changed, no stream's settings changed, and no message
// came or went in a stream that is not the identity's to write, nor a
// consumer appeared.
//
// FANOUT_REDTEAM_NATS_CONF runs it against another configuration file
// (the one before replays went through Postgres, say), to see attacks
// succeed.

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// redTeamTarget is one subject an attacker aims at, the body it sends,
// and whose object it is (an identity acting on its own is not an attack).
type redTeamTarget struct {
	subject, body, owner string
}

// redTeamTargets generates the targets: every consumer's API calls and
// acks, both streams' API calls, and the streams' subjects.
func redTeamTargets(cfg *settings, consumers map[string]string) []redTeamTarget {
	events, letters := cfg.Stream.Name, cfg.Subscribers.DeadLetterStream
	var ts []redTeamTarget
	for _, c := range slices.Sorted(maps.Keys(consumers)) {
		owner := consumers[c]
		api := func(verb string) string { return "$JS.API.CONSUMER." + verb + "." + events + "." + c }
		push := fmt.Sprintf(`{"stream_name":%q,"config":{"durable_name":%q,"deliver_subject":"$JS.API.CONSUMER.RESET.%s.invoicing","ack_policy":"none","filter_subject":"events.redteam.reset"}}`, events, c, events)
		ts = append(ts,
			redTeamTarget{api("INFO"), ``, owner},
			redTeamTarget{api("RESET"), `{"seq": 1000000}`, owner},
			redTeamTarget{api("MSG.NEXT"), `{"batch": 1000, "no_wait": true}`, owner},
			redTeamTarget{api("DELETE"), ``, owner},
			redTeamTarget{api("PAUSE"), `{"pause_until": "2100-01-01T00:00:00Z"}`, owner},
			redTeamTarget{api("UNPIN"), `{"group": "ordered"}`, owner},
			redTeamTarget{api("LEADER.STEPDOWN"), ``, owner},
			redTeamTarget{"$JS.API.CONSUMER.CREATE." + events + "." + c, push, owner},
			redTeamTarget{"$JS.API.CONSUMER.CREATE." + events + "." + c + ".events.redteam.reset", push, owner},
			redTeamTarget{"$JS.API.CONSUMER.DURABLE.CREATE." + events + "." + c, push, owner},
			// Acks of the first events, as delivered once and as the
			// server writes ack subjects.
			redTeamTarget{"$JS.ACK." + events + "." + c + ".1.1.1.1700000000000000000.0", "+ACK", owner},
			redTeamTarget{"$JS.ACK." + events + "." + c + ".1.2.2.1700000000000000000.0", "+TERM", owner},
		)
	}
	for _, s := range []string{events, letters} {
		api := func(verb string) string { return "$JS.API.STREAM." + verb + "." + s }
		ts = append(ts,
			redTeamTarget{api("INFO"), `{"subjects_filter": ">"}`, ""},
			redTeamTarget{api("UPDATE"), fmt.Sprintf(`{"name":%q,"subjects":[">"],"max_msgs":1}`, s), ""},
			redTeamTarget{api("PURGE"), `{}`, ""},
			redTeamTarget{api("DELETE"), ``, ""},
			redTeamTarget{api("MSG.DELETE"), `{"seq": 1, "no_erase": true}`, ""},
			redTeamTarget{api("CREATE"), fmt.Sprintf(`{"name":%q,"subjects":["redteam.>"]}`, s), ""},
			redTeamTarget{api("LEADER.STEPDOWN"), ``, ""},
			redTeamTarget{"$JS.API.CONSUMER.CREATE." + s, fmt.Sprintf(`{"stream_name":%q,"config":{"deliver_subject":"$JS.API.CONSUMER.RESET.%s.invoicing","ack_policy":"none"}}`, s, events), ""},
		)
	}
	ts = append(ts, redTeamTarget{"events.redteam.x", `{"seq": 1000000}`, "relay"})
	for _, name := range registry.Default.Names() {
		ts = append(ts, redTeamTarget{"deadletter." + name + ".x", `{}`, name})
	}
	return ts
}

func TestRedTeamGenerated(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cfg := loadConfig(t)
	ns, shipped := startRedTeamNATS(t)
	rel, prov, admin, adminDL := ns.connect(t, "relay"), ns.connect(t, "provisioner"), ns.connect(t, "admin"), ns.connect(t, "admin_deadletter")
	readers := provisionEverything(t, ctx, cfg, prov, admin, shipped)
	consumers := map[string]string{} // name: owner
	for _, name := range registry.Default.Names() {
		consumers[name] = name
	}
	for name := range readers {
		consumers[name] = "relay"
		if strings.HasPrefix(name, stream.OperatorConsumerPrefix) {
			consumers[name] = "operator"
		}
	}
	// The events the subscribers wait for, control messages, and a dead
	// letter of each subscriber's.
	for i := range 4 {
		publishEvent(t, ctx, rel, "events."+shop.OrderCreated, fmt.Sprintf(`{"order_id": %d}`, i+1))
		publishEvent(t, ctx, rel, "events.product.updated", fmt.Sprintf(`{"product_id": %d}`, i+1))
	}
	publishEvent(t, ctx, rel, "events.redteam.reset", `{"seq": 1000000}`)
	identities := []*natsClient{rel, prov, ns.connect(t, "operator")}
	for _, name := range registry.Default.Names() {
		c := ns.connect(t, name)
		if _, err := c.js.Publish(ctx, "deadletter."+name+"."+shop.OrderCreated, []byte(`{}`)); err != nil {
			t.Fatalf("%s publishes its dead letter: %v", name, err)
		}
		identities = append(identities, c)
	}

	targets := redTeamTargets(cfg, consumers)
	forms := []string{"publish", "reply", "delivery"}
	t.Logf("generated red team: %d identities × %d targets × %d forms = %d attempts", len(identities), len(targets), len(forms), len(identities)*len(targets)*len(forms))
	own := map[string]string{ // a consumer each identity may pull from: the reply form's second request
		"relay": stream.AuditConsumer, "operator": stream.ReindexConsumer,
	}
	for _, name := range registry.Default.Names() {
		own[name] = name
	}
	for _, c := range identities {
		t.Run(c.user, func(t *testing.T) {
			before := redTeamState(t, ctx, cfg, admin, adminDL)
			inbox := c.nc.NewInbox()
			sub, err := c.nc.SubscribeSync(inbox)
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe() //nolint:errcheck
			for i, tg := range targets {
				// Publish: a request answered into its own inbox.
				_ = c.nc.PublishRequest(tg.subject, inbox, []byte(tg.body))
				// Reply: the server's answer to a request it may make,
				// and a message pulled from its own consumer, delivered
				// to the target.
				_ = c.nc.PublishRequest("$JS.API.INFO", tg.subject, nil)
				if name, ok := own[c.user]; ok {
					_ = c.nc.PublishRequest("$JS.API.CONSUMER.MSG.NEXT."+cfg.Stream.Name+"."+name, tg.subject, []byte(`{"batch": 1, "no_wait": true}`))
				}
				// Delivery: a push consumer of its own into the target.
				req := fmt.Sprintf(`{"stream_name":%q,"config":{"durable_name":"redteam_%d","deliver_subject":%q,"ack_policy":"none","filter_subject":"events.redteam.reset"}}`, cfg.Stream.Name, i, tg.subject)
				_ = c.nc.PublishRequest(fmt.Sprintf("$JS.API.CONSUMER.CREATE.%s.redteam_%d", cfg.Stream.Name, i), inbox, []byte(req))
			}
			if err := c.nc.FlushTimeout(10 * time.Second); err != nil {
				t.Fatal(err)
			}
			// The server answers API requests in a pool of its own, later
			// under load: the state is read once it holds still.
			after := redTeamState(t, ctx, cfg, admin, adminDL)
			for still := time.Now().Add(20 * time.Second); time.Now().Before(still); {
				time.Sleep(time.Second)
				again := redTeamState(t, ctx, cfg, admin, adminDL)
				if maps.Equal(again, after) {
					break
				}
				after = again
			}
			var changed []string
			for _, k := range slices.Sorted(maps.Keys(after)) {
				if before[k] != after[k] && !ownedBy(k, c.user, consumers) {
					changed = append(changed, fmt.Sprintf("%s: %s → %s", k, before[k], after[k]))
				}
			}
			for _, k := range slices.Sorted(maps.Keys(before)) {
				if _, ok := after[k]; !ok && !ownedBy(k, c.user, consumers) {
					changed = append(changed, k+": gone")
				}
			}
			if len(changed) > 0 {
				t.Errorf("%s's attempts changed what is not its own:\n  %s", c.user, strings.Join(changed, "\n  "))
			}
			// Whatever got through is undone, so that the next identity
			// is judged alone.
			cleanRedTeam(t, ctx, cfg, admin, consumers)
		})
	}
}

// ownedBy reports whether state key k (from redTeamState) is identity
// user's own: its consumer, or the stream it writes.
func ownedBy(k, user string, consumers map[string]string) bool {
	switch {
	case strings.HasPrefix(k, "consumer "):
		return consumers[strings.TrimPrefix(k, "consumer ")] == user
	case k == "stream EVENTS messages":
		return user == "relay"
	case k == "stream DEADLETTER messages": // each letter's subject is checked too
		return consumers[user] == user
	case strings.HasPrefix(k, "letters deadletter."):
		return strings.HasPrefix(k, "letters deadletter."+user+".")
	}
	return false
}

// redTeamState is what an attack would change, read as the streams'
// administrators: each consumer's position and configuration, each
// stream's settings and messages, and the dead letters by subject.
func redTeamState(t *testing.T, ctx context.Context, cfg *settings, admin, adminDL *natsClient) map[string]string {
	t.Helper()
	state := map[string]string{}
	for _, sc := range []struct {
		c    *natsClient
		name string
	}{{admin, cfg.Stream.Name}, {adminDL, cfg.Subscribers.DeadLetterStream}} {
		s, err := sc.c.js.Stream(ctx, sc.name)
		if err != nil {
			t.Fatalf("stream %s: %v", sc.name, err)
		}
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(">"))
		if err != nil {
			t.Fatal(err)
		}
		settings, _ := json.Marshal(info.Config)
		state["stream "+sc.name+" settings"] = string(settings)
		state["stream "+sc.name+" messages"] = fmt.Sprintf("%d (%d..%d)", info.State.Msgs, info.State.FirstSeq, info.State.LastSeq)
		if sc.name == cfg.Subscribers.DeadLetterStream {
			for subject, n := range info.State.Subjects {
				state["letters "+subject] = fmt.Sprint(n)
			}
		}
		list := s.ListConsumers(ctx)
		for ci := range list.Info() {
			settings, _ := json.Marshal(ci.Config)
			state["consumer "+ci.Name] = fmt.Sprintf("ack floor %d, delivered %d, %d pending, %d ack pending, paused %t, %s",
				ci.AckFloor.Stream, ci.Delivered.Stream, ci.NumPending, ci.NumAckPending, ci.Paused, settings)
		}
		if err := list.Err(); err != nil {
			t.Fatal(err)
		}
	}
	return state
}

// cleanRedTeam deletes, as the administrator, every consumer of the
// stream that is none of fanout's (an attack made it).
func cleanRedTeam(t *testing.T, ctx context.Context, cfg *settings, admin *natsClient, consumers map[string]string) {
	t.Helper()
	s, err := admin.js.Stream(ctx, cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	for name := range s.ListConsumers(ctx).Info() {
		if _, ok := consumers[name.Name]; !ok {
			if err := s.DeleteConsumer(ctx, name.Name); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// publishEvent publishes an event as the relay would.
func publishEvent(t *testing.T, ctx context.Context, rel *natsClient, subject, body string) {
	t.Helper()
	msg := nats.NewMsg(subject)
	msg.Data = []byte(body)
	if _, err := rel.js.PublishMsg(ctx, msg); err != nil {
		t.Fatalf("relay publishes %s: %v", subject, err)
	}
}
