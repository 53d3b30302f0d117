package deploy_test

// The red-team attacks through the reader consumers (the relay's audits',
// the operator's reindex's): a consumer its user could create with a
// configuration of its choosing became a push consumer delivering an event
// into the JetStream API of another consumer, the event's body the
// request. Judged by their outcome: every subscriber's consumer (ack floor,
// delivered, pending, ack pending, configuration) and every reader
// consumer's configuration are what they were.
//
// FANOUT_REDTEAM_NATS_CONF runs them against another configuration file
// (the one before the provisioner made the readers, say), to see each
// attack succeed.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// consumerState is what an attack on a consumer would change.
type consumerState struct {
	ackFloor, delivered, pending uint64
	ackPending                   int
	config                       jetstream.ConsumerConfig
}

func (s consumerState) String() string {
	return fmt.Sprintf("ack floor %d, delivered %d, %d pending, %d ack pending", s.ackFloor, s.delivered, s.pending, s.ackPending)
}

func TestRedTeamReaderConsumers(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := loadConfig(t)
	ns, shipped := startRedTeamNATS(t)
	rel, prov, op, admin := ns.connect(t, "relay"), ns.connect(t, "provisioner"), ns.connect(t, "operator"), ns.connect(t, "admin")

	readers := provisionEverything(t, ctx, cfg, prov, admin, shipped)
	adminEvents, err := admin.js.Stream(ctx, cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}

	// The events: orders and product changes the subscribers wait for,
	// then the control messages an attacker needs, as events the relay may
	// publish (a writer may commit any payload, too).
	publish := func(subject, body string) uint64 {
		t.Helper()
		msg := nats.NewMsg(subject)
		msg.Data = []byte(body)
		id := strconv.Itoa(int(time.Now().UnixNano()))
		msg.Header.Set(wire.EventIDHeader, id)
		ack, err := rel.js.PublishMsg(ctx, msg, jetstream.WithMsgID(id))
		if err != nil {
			t.Fatalf("relay publishes %s: %v", subject, err)
		}
		return ack.Sequence
	}
	for i := range 6 {
		publish("events."+shop.OrderCreated, fmt.Sprintf(`{"order_id": %d}`, i+1))
	}
	for i := range 2 {
		publish("events.product.updated", fmt.Sprintf(`{"product_id": %d}`, i+1))
	}
	control := map[string]string{ // subject: body
		"events.redteam.reset.invoicing":   `{"seq": 6}`, // skips invoicing's orders 1 to 5
		"events.redteam.reset.searchindex": `{"seq": 8}`, // skips searchindex's product 1 (seq 7)
		"events.redteam.next":              `1000`,       // a pull of 1000 messages
	}
	for subject, body := range control {
		publish(subject, body)
	}

	state := func(t *testing.T, name string) consumerState {
		t.Helper()
		c, err := admin.js.Consumer(ctx, cfg.Stream.Name, name)
		if err != nil {
			t.Fatalf("consumer %s: %v", name, err)
		}
		info := c.CachedInfo()
		return consumerState{info.AckFloor.Stream, info.Delivered.Stream, info.NumPending, info.NumAckPending, info.Config}
	}
	subscriberNames := registry.Default.Names()
	snapshot := func(t *testing.T) map[string]consumerState {
		t.Helper()
		states := map[string]consumerState{}
		for _, name := range subscriberNames {
			states[name] = state(t, name)
		}
		return states
	}
	// unchanged checks, for two seconds (a push consumer delivers within
	// it), that no subscriber's consumer moved from before and each reader
	// is as provisioned; it reports the first change of each.
	unchanged := func(t *testing.T, attack string, before map[string]consumerState) {
		t.Helper()
		reported := map[string]bool{}
		report := func(name, format string, args ...any) {
			t.Helper()
			if !reported[name] {
				reported[name] = true
				t.Errorf("%s: "+format, append([]any{attack}, args...)...)
			}
		}
		for range 20 {
			for _, name := range subscriberNames {
				got := state(t, name)
				if ds := stream.ConsumerDifferences(got.config, before[name].config); len(ds) > 0 {
					report(name, "consumer %s changed: %s", name, stream.Join(ds))
				}
				if got.String() != before[name].String() {
					report(name, "consumer %s went from %s to %s: the attack got through", name, before[name], got)
				}
			}
			for name, want := range readers {
				have, err := stream.ConsumerConfigOf(ctx, admin.js, cfg.Stream.Name, name)
				if err != nil {
					report(name, "reader %s: %v", name, err)
				} else if ds := stream.ReaderDifferences(have, want); len(ds) > 0 {
					report(name, "reader %s changed: %s", name, stream.Join(ds))
				}
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	unchanged(t, "setup", snapshot(t))

	// attempt makes a request an attacker makes, its outcome logged: the
	// consumers' states judge it.
	attempt := func(t *testing.T, c *natsClient, what string, op func(ctx context.Context) error) {
		t.Helper()
		actx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		t.Logf("%s %s: %v", c.user, what, op(actx))
	}
	// refused checks that the server refused c's requests on subjects
	// (after the outcome, so that a run against a configuration that
	// allows them reports the outcome first).
	refused := func(t *testing.T, c *natsClient, subjects ...string) {
		t.Helper()
		if t.Failed() {
			return
		}
		for _, s := range subjects {
			c.waitViolation(t, "Publish", s)
		}
		c.checkClean(t)
	}
	api := func(verb, name string) string { return "$JS.API.CONSUMER." + verb + "." + cfg.Stream.Name + "." + name }

	for _, tc := range []struct {
		c            *natsClient
		reader       string
		resetTarget  string
		resetControl string
		nextTarget   string
	}{
		{rel, stream.AuditConsumer, invoicing.Name, "events.redteam.reset.invoicing", salesledger.Name},
		{op, stream.ReindexConsumer, searchindex.Name, "events.redteam.reset.searchindex", cacheinval.Name},
	} {
		c, reader := tc.c, tc.reader
		push := func(deliver, filter string) jetstream.ConsumerConfig {
			return jetstream.ConsumerConfig{Durable: reader, DeliverSubject: deliver, AckPolicy: jetstream.AckNonePolicy, FilterSubjects: []string{filter}}
		}
		t.Run(c.user+"'s reader cannot become a push consumer into "+tc.resetTarget+"'s CONSUMER.RESET", func(t *testing.T) {
			before := snapshot(t)
			attempt(t, c, "deletes its reader "+reader, func(ctx context.Context) error { return c.js.DeleteConsumer(ctx, cfg.Stream.Name, reader) })
			attempt(t, c, "creates "+reader+" pushing to "+api("RESET", tc.resetTarget), func(ctx context.Context) error {
				_, err := c.js.CreateConsumer(ctx, cfg.Stream.Name, push(api("RESET", tc.resetTarget), tc.resetControl))
				return err
			})
			unchanged(t, c.user+"'s push consumer into "+tc.resetTarget+"'s reset", before)
			refused(t, c, api("DELETE", reader), api("CREATE", reader))
			restoreReader(t, ctx, adminEvents, readers[reader])
		})
		t.Run(c.user+"'s reader cannot become a push consumer into "+tc.nextTarget+"'s CONSUMER.MSG.NEXT", func(t *testing.T) {
			before := snapshot(t)
			attempt(t, c, "deletes its reader "+reader, func(ctx context.Context) error { return c.js.DeleteConsumer(ctx, cfg.Stream.Name, reader) })
			attempt(t, c, "creates "+reader+" pushing to "+api("MSG.NEXT", tc.nextTarget), func(ctx context.Context) error {
				_, err := c.js.CreateConsumer(ctx, cfg.Stream.Name, push(api("MSG.NEXT", tc.nextTarget), "events.redteam.next"))
				return err
			})
			unchanged(t, c.user+"'s push consumer into "+tc.nextTarget+"'s pulls", before)
			refused(t, c, api("DELETE", reader), api("CREATE", reader))
			restoreReader(t, ctx, adminEvents, readers[reader])
		})
		t.Run(c.user+" cannot create, change or delete its reader", func(t *testing.T) {
			before := snapshot(t)
			changed := readers[reader]
			changed.FilterSubjects = []string{"events." + shop.OrderCreated}
			changed.InactiveThreshold = time.Second
			attempt(t, c, "updates "+reader+" to another filter and an inactive threshold", func(ctx context.Context) error {
				_, err := c.js.UpdateConsumer(ctx, cfg.Stream.Name, changed)
				return err
			})
			attempt(t, c, "deletes "+reader, func(ctx context.Context) error { return c.js.DeleteConsumer(ctx, cfg.Stream.Name, reader) })
			attempt(t, c, "creates "+reader+" with another filter", func(ctx context.Context) error {
				_, err := c.js.CreateConsumer(ctx, cfg.Stream.Name, changed)
				return err
			})
			unchanged(t, c.user+" rewriting its reader", before)
			refused(t, c, api("CREATE", reader), api("DELETE", reader), api("CREATE", reader))
			restoreReader(t, ctx, adminEvents, readers[reader])
		})
		t.Run(c.user+"'s pull whose reply is "+tc.resetTarget+"'s CONSUMER.RESET moves nothing", func(t *testing.T) {
			// Its reader moved (a reset it may make) to the control
			// message, then pulled with a reply subject of the API: the
			// pulled message would be the request.
			before := snapshot(t)
			seq := publish(tc.resetControl, control[tc.resetControl])
			attempt(t, c, "resets "+reader+" to "+strconv.FormatUint(seq, 10), func(ctx context.Context) error {
				_, err := c.js.ResetConsumerToSequence(ctx, cfg.Stream.Name, reader, seq)
				return err
			})
			for _, reply := range []string{api("RESET", tc.resetTarget), api("MSG.NEXT", tc.nextTarget)} {
				if err := c.nc.PublishRequest(api("MSG.NEXT", reader), reply, []byte(`{"batch":1,"no_wait":true}`)); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := c.js.Stream(ctx, cfg.Stream.Name); err != nil { // answered in order: the pulls were handled
				t.Fatal(err)
			}
			unchanged(t, c.user+"'s pull replying into "+tc.resetTarget+"'s reset", before)
			if !t.Failed() {
				c.checkClean(t)
			}
		})
	}

	// The operator's credential moved any subscriber's consumer (a reset,
	// forward past events the subscriber then never got), and nothing
	// recorded it. A replay is now a request in Postgres that the
	// subscriber carries out; the operator holds no reset, and a
	// subscriber only its own.
	sub := ns.connect(t, invoicing.Name)
	for _, tc := range []struct {
		c       *natsClient
		targets []string
	}{
		{op, []string{invoicing.Name, searchindex.Name}},
		{sub, []string{salesledger.Name, cacheinval.Name}},
	} {
		t.Run(tc.c.user+" cannot move another role's consumer", func(t *testing.T) {
			before := snapshot(t)
			for _, name := range tc.targets {
				attempt(t, tc.c, "resets "+name+" to sequence 9", func(ctx context.Context) error {
					_, err := tc.c.js.ResetConsumerToSequence(ctx, cfg.Stream.Name, name, 9)
					return err
				})
			}
			unchanged(t, tc.c.user+"'s reset of "+strings.Join(tc.targets, " and "), before)
			var subjects []string
			for _, name := range tc.targets {
				subjects = append(subjects, api("RESET", name))
			}
			refused(t, tc.c, subjects...)
		})
	}
}

// provisionEverything makes what `fanout provision` makes, as the
// provisioner: both streams, every subscriber's consumer and the readers
// (returned by name). Unless strict (a configuration whose provisioner
// may not make a reader), the administrator makes the readers it cannot;
// strict, admin may be nil.
func provisionEverything(t *testing.T, ctx context.Context, cfg *settings, prov, admin *natsClient, strict bool) map[string]jetstream.ConsumerConfig {
	t.Helper()
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	if err := stream.Ensure(ctx, prov.js, cfg.Stream, relay.RepublishDelay(cfg.Relay), discard); err != nil {
		t.Fatalf("provision the stream: %v", err)
	}
	if _, err := subscribers.ProvisionDeadLetterStream(ctx, prov.js, cfg.Subscribers, cfg.Stream.Replicas, stream.Changes{}, discard); err != nil {
		t.Fatalf("provision the dead-letter stream: %v", err)
	}
	events, err := prov.js.Stream(ctx, cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range registry.Default.All() {
		if _, err := subscribers.ProvisionConsumer(ctx, events, d, cfg.Subscribers, cfg.Stream); err != nil {
			t.Fatalf("provision consumer %s: %v", d.Name, err)
		}
	}
	readers := map[string]jetstream.ConsumerConfig{
		stream.AuditConsumer:        stream.AuditConsumerConfig(stream.AuditConsumer),
		stream.AuditCommandConsumer: stream.AuditConsumerConfig(stream.AuditCommandConsumer),
		stream.ReindexConsumer:      searchindex.ReplayConsumerConfig(cfg.Stream),
	}
	for _, want := range readers {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := stream.EnsureReader(pctx, events, want, true)
		cancel()
		if err != nil {
			if strict {
				t.Fatalf("the provisioner makes reader %s: %v", want.Durable, err)
			}
			adminEvents, err := admin.js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := stream.EnsureReader(ctx, adminEvents, want, true); err != nil {
				t.Fatal(err)
			}
		}
	}
	if strict {
		prov.checkClean(t)
	}
	return readers
}

// restoreReader makes the reader want again as the stream's administrator,
// after an attack that may have replaced or deleted it.
func restoreReader(t *testing.T, ctx context.Context, events jetstream.Stream, want jetstream.ConsumerConfig) {
	t.Helper()
	if err := events.DeleteConsumer(ctx, want.Durable); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		t.Fatal(err)
	}
	if _, err := events.CreateConsumer(ctx, want); err != nil {
		t.Fatal(err)
	}
}
