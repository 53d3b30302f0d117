package deploy_test

// These tests run the real relay and subscribers under the production
// nats-server configuration (deploy/nats/nats-server.conf) and the database
// roles of deploy/postgres/roles.sql, and show what each role may and may
// not do: every refusal is the server's own (a NATS permissions violation
// naming the subject, SQLSTATE 42501 from PostgreSQL).

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"maps"
	"slices"
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
	"github.com/fanout/fanout/subscribers/searchindex"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ---------------------------------------------------------------------------
// NATS: what each user is refused

// TestNATSPermissions provisions the streams and the subscribers' consumers
// as the provisioning identity (`fanout provision`'s calls), checks that
// the relay and each subscriber can do their work with everything
// provisioned (the calls they make with provisioning set to verify), and
// then what each identity is refused.
func TestNATSPermissions(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cfg := loadConfig(t)
	ns := startNATS(t)
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	rel := ns.connect(t, "relay")
	prov := ns.connect(t, "provisioner")
	op := ns.connect(t, "operator")
	// Every subscriber in the registry, each as its own user.
	handlers := map[*natsClient]subscribers.Declaration{}
	client := map[string]*natsClient{}
	for _, d := range registry.Default.All() {
		c := ns.connect(t, d.Name)
		handlers[c], client[d.Name] = d, c
	}
	inv, cin, six := client[invoicing.Name], client[cacheinval.Name], client[searchindex.Name]

	// The provisioner creates EVENTS and DEADLETTER and every subscriber's
	// consumer, and runs again (update) without harm.
	minDup := relay.RepublishDelay(cfg.Relay)
	for range 2 {
		provisionEverything(t, ctx, cfg, prov, nil, true)
	}

	// The relay checks EVENTS (verify) and publishes with PubAcks.
	verify := cfg.Stream
	verify.Provision = "verify"
	if err := stream.Ensure(ctx, rel.js, verify, minDup, discard); err != nil {
		t.Fatalf("relay verifies the stream: %v", err)
	}
	publish := func(subject string, id int) uint64 {
		t.Helper()
		msg := nats.NewMsg(subject)
		msg.Data = []byte(`{"order_id": 1, "product_id": 1}`)
		msg.Header.Set(wire.EventIDHeader, strconv.Itoa(id))
		ack, err := rel.js.PublishMsg(ctx, msg, jetstream.WithMsgID(strconv.Itoa(id)), jetstream.WithExpectStream(cfg.Stream.Name))
		if err != nil {
			t.Fatalf("relay publishes %s: %v", subject, err)
		}
		return ack.Sequence
	}
	orderSeq := publish("events."+shop.OrderCreated, 1)
	productSeq := publish("events.product.updated", 2)

	// Each subscriber looks up the streams and its own consumer, as the
	// runtime does with provisioning set to verify.
	for c, d := range handlers {
		if _, err := c.js.Stream(ctx, cfg.Subscribers.DeadLetterStream); err != nil {
			t.Fatalf("%s looks up the dead-letter stream: %v", c.user, err)
		}
		s, err := c.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatalf("%s looks up the stream: %v", c.user, err)
		}
		if _, err := s.Consumer(ctx, d.Name); err != nil {
			t.Fatalf("%s looks up its consumer: %v", c.user, err)
		}
		c.checkClean(t)
	}
	// The relay lists the consumers of EVENTS: the audit reads their ack
	// floors for the events the stream's limits removed.
	if events, err := rel.js.Stream(ctx, cfg.Stream.Name); err != nil {
		t.Fatal(err)
	} else {
		list, listed := events.ListConsumers(ctx), 0
		for range list.Info() {
			listed++
		}
		if err := list.Err(); err != nil || listed < len(registry.Default.Names()) {
			t.Fatalf("the relay lists %d consumers of %s (%v), want every subscriber's", listed, cfg.Stream.Name, err)
		}
	}
	eventCount := func() uint64 {
		t.Helper()
		info, err := rel.js.Stream(ctx, cfg.Stream.Name) // STREAM.INFO, allowed to the relay
		if err != nil {
			t.Fatal(err)
		}
		return info.CachedInfo().State.Msgs
	}

	t.Run("a subscriber works its own consumer", func(t *testing.T) {
		for _, tc := range []struct {
			c         *natsClient
			name, typ string
			seq       uint64
		}{
			{inv, invoicing.Name, shop.OrderCreated, orderSeq},
			{six, searchindex.Name, "product.updated", productSeq},
		} {
			events, err := tc.c.js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			c, err := events.Consumer(ctx, tc.name)
			if err != nil {
				t.Fatal(err)
			}
			batch, err := c.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			var got []jetstream.Msg
			for m := range batch.Messages() {
				got = append(got, m)
			}
			if len(got) != 1 || got[0].Subject() != "events."+tc.typ {
				t.Fatalf("%s fetched %d messages (%v), want its %s", tc.name, len(got), batch.Error(), tc.typ)
			}
			if err := got[0].InProgress(); err != nil {
				t.Fatal(err)
			}
			if err := got[0].DoubleAck(ctx); err != nil {
				t.Fatalf("%s acks: %v", tc.name, err)
			}
			ack, err := tc.c.js.Publish(ctx, "deadletter."+tc.name+"."+tc.typ, []byte("{}"))
			if err != nil || ack.Stream != cfg.Subscribers.DeadLetterStream {
				t.Fatalf("%s publishes its dead letter: %v", tc.name, err)
			}
			info, err := c.Info(ctx)
			if err != nil || info.AckFloor.Stream != tc.seq || info.NumAckPending != 0 {
				t.Fatalf("%s consumer after the ack: %+v (%v)", tc.name, info, err)
			}
			// It carries out the replays the operator requests: a reset
			// of its own consumer.
			if _, err := tc.c.js.ResetConsumerToSequence(ctx, cfg.Stream.Name, tc.name, tc.seq); err != nil {
				t.Fatalf("%s resets its own consumer (a replay): %v", tc.name, err)
			}
			if info, err := c.Info(ctx); err != nil || info.NumPending != 1 || info.AckFloor.Stream >= tc.seq {
				t.Fatalf("%s consumer after its reset to %d: %+v (%v), want its event pending again", tc.name, tc.seq, info, err)
			}
			tc.c.checkClean(t) // none of the above was refused
			// It reads only what its consumer delivers: no event by
			// sequence (the cache invalidator has no business reading
			// orders).
			tc.c.deniedRequest(t, "$JS.API.DIRECT.GET.EVENTS", func(ctx context.Context) error {
				_, err := events.GetMsg(ctx, tc.seq) // a direct get: EVENTS allows them
				return err
			})
			tc.c.checkClean(t)
		}
	})

	t.Run("a dead letter a subscriber forges is refused", func(t *testing.T) {
		// A subscriber may publish dead letters under its own name only;
		// what it writes in them is up to it. The operator tools take the
		// subscriber from the subject, refuse a letter that says otherwise,
		// and check the event it names against the events stream: a forged
		// letter redriven would write a checkpoint and make a subscriber
		// skip a real event.
		admin := ns.connect(t, "admin")
		dls, err := ns.connect(t, "admin_deadletter").js.Stream(ctx, cfg.Subscribers.DeadLetterStream)
		if err != nil {
			t.Fatal(err)
		}
		forge := func(c *natsClient, claimed, typ string, seq uint64, id int) *jetstream.RawStreamMsg {
			t.Helper()
			msg := nats.NewMsg("deadletter." + c.user + "." + typ)
			msg.Data = []byte(`{"order_id": 1, "product_id": 1}`)
			msg.Header.Set(subscribers.DeadSubscriberHeader, claimed)
			msg.Header.Set(subscribers.DeadReasonHeader, "forged")
			msg.Header.Set(wire.EventIDHeader, strconv.Itoa(id))
			msg.Header.Set(subscribers.DeadSubjectHeader, "events."+typ)
			msg.Header.Set(subscribers.DeadStreamSeqHeader, strconv.FormatUint(seq, 10))
			ack, err := c.js.PublishMsg(ctx, msg)
			if err != nil {
				t.Fatalf("%s publishes a letter under its own name: %v", c.user, err)
			}
			m, err := dls.GetMsg(ctx, ack.Sequence)
			if err != nil {
				t.Fatal(err)
			}
			return m
		}
		refused := func(c *natsClient, what string, err error) {
			t.Helper()
			if !errors.Is(err, subscribers.ErrDeadLetterRefused) {
				t.Errorf("%s: %s: accepted (%v)", c.user, what, err)
				return
			}
			t.Logf("refused: %s, %s: %v", c.user, what, err)
		}
		for c, d := range handlers {
			other := invoicing.Name
			if c == inv {
				other = cacheinval.Name
			}
			// Speaking for another subscriber.
			_, err := subscribers.ParseDeadLetter(forge(c, other, shop.OrderCreated, orderSeq, 1), cfg.Subscribers, cfg.Stream)
			refused(c, "a letter claiming to be "+other+"'s", err)

			// In its own name, but naming an event that is not the one at
			// the sequence given, or one it does not receive.
			wrongID, typ := 2, shop.OrderCreated // the order's sequence holds event 1
			if !slices.Contains(d.EventTypes, shop.OrderCreated) {
				wrongID = 1 // the order event itself, which it never receives
			}
			dl, err := subscribers.ParseDeadLetter(forge(c, c.user, typ, orderSeq, wrongID), cfg.Subscribers, cfg.Stream)
			if err != nil {
				t.Fatalf("%s: a letter in its own name: %v", c.user, err)
			}
			refused(c, "a letter naming an event that is not its own", dl.Verify(ctx, admin.js, cfg.Stream))
		}
		// A letter that agrees with itself and with the stream is read.
		dl, err := subscribers.ParseDeadLetter(forge(inv, inv.user, shop.OrderCreated, orderSeq, 1), cfg.Subscribers, cfg.Stream)
		if err != nil {
			t.Fatal(err)
		}
		if err := dl.Verify(ctx, admin.js, cfg.Stream); err != nil || !dl.Verified || dl.Event.ID != 1 {
			t.Errorf("a true letter: %v (verified %v, event %d)", err, dl.Verified, dl.Event.ID)
		}
	})

	t.Run("a reindex replays the stream as the operator, not as the search indexer", func(t *testing.T) {
		// Through its consumer, which the provisioner made; the operator
		// only moves it and pulls.
		var got []subscribers.Event
		read, pos, err := searchindex.ReadEvents(ctx, op.js, verify, 0, productSeq, func(evs []subscribers.Event) error {
			got = append(got, evs...)
			return nil
		})
		if err != nil {
			t.Fatalf("the operator replays: %v", err)
		}
		if read != 1 || len(got) != 1 || got[0].ID != 2 || got[0].Type != "product.updated" || pos != productSeq {
			t.Fatalf("replay read %d events %+v up to %d; want the product event (id 2, seq %d) only", read, got, pos, productSeq)
		}
		events, err := op.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatal(err)
		}
		c, err := events.Consumer(ctx, stream.ReindexConsumer)
		if err != nil {
			t.Fatalf("replay consumer after the replay: %v", err)
		}
		if ds := stream.ReaderDifferences(c.CachedInfo().Config, searchindex.ReplayConsumerConfig(cfg.Stream)); len(ds) > 0 {
			t.Errorf("replay consumer after the replay: %s", stream.Join(ds))
		}
		op.checkClean(t)
		// A replay consumer could carry any filter, so no subscriber may
		// create one: it would read events that are not its own.
		for _, c := range []*natsClient{six, inv} {
			cEvents, err := c.js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			c.deniedRequest(t, "$JS.API.CONSUMER.CREATE.EVENTS."+stream.ReindexConsumer, func(ctx context.Context) error {
				_, err := cEvents.CreateConsumer(ctx, jetstream.ConsumerConfig{Name: stream.ReindexConsumer, AckPolicy: jetstream.AckNonePolicy})
				return err
			})
			c.checkClean(t)
		}
	})

	t.Run("each identity is refused what it must not do", func(t *testing.T) {
		// One refusal per API each identity must not reach, each logged.
		type refusal struct {
			what, subject string
			op            func(ctx context.Context, c *natsClient) error
		}
		raw := func(subject, body string) func(ctx context.Context, c *natsClient) error {
			return func(ctx context.Context, c *natsClient) error {
				_, err := c.nc.RequestWithContext(ctx, subject, []byte(body))
				return err
			}
		}
		update := func(name string) refusal {
			return refusal{"change stream " + name, "$JS.API.STREAM.UPDATE." + name, func(ctx context.Context, c *natsClient) error {
				sc := stream.JetStreamConfig(cfg.Stream)
				if name == cfg.Subscribers.DeadLetterStream {
					sc = subscribers.DeadLetterStreamConfig(cfg.Subscribers, cfg.Stream.Replicas)
				}
				sc.MaxAge = time.Minute
				_, err := c.js.UpdateStream(ctx, sc)
				return err
			}}
		}
		create := func(name string) refusal {
			return refusal{"create stream " + name + "2", "$JS.API.STREAM.CREATE." + name + "2", raw("$JS.API.STREAM.CREATE."+name+"2", `{"name":"`+name+`2","subjects":["x.`+name+`"]}`)}
		}
		purge := func(name string) refusal {
			return refusal{"purge stream " + name, "$JS.API.STREAM.PURGE." + name, raw("$JS.API.STREAM.PURGE."+name, `{}`)}
		}
		deleteStream := func(name string) refusal {
			return refusal{"delete stream " + name, "$JS.API.STREAM.DELETE." + name, raw("$JS.API.STREAM.DELETE."+name, ``)}
		}
		deleteMsg := func(name string) refusal {
			return refusal{"delete a message of " + name, "$JS.API.STREAM.MSG.DELETE." + name, raw("$JS.API.STREAM.MSG.DELETE."+name, `{"seq":1}`)}
		}
		getMsg := func(name string) refusal {
			return refusal{"read a message of " + name + " by sequence", "$JS.API.STREAM.MSG.GET." + name, raw("$JS.API.STREAM.MSG.GET."+name, `{"seq":1}`)}
		}
		directGet := func(name string) refusal {
			return refusal{"read messages of " + name + " by direct get", "$JS.API.DIRECT.GET." + name, raw("$JS.API.DIRECT.GET."+name, `{"seq":1,"batch":10}`)}
		}
		publishTo := func(subject string) refusal {
			return refusal{"publish to " + subject, subject, func(ctx context.Context, c *natsClient) error {
				_, err := c.js.Publish(ctx, subject, []byte(`{}`))
				return err
			}}
		}
		consumerCreate := func(name string, filter string) refusal {
			subject := "$JS.API.CONSUMER.CREATE.EVENTS." + name
			if filter != "" {
				subject += "." + filter
			}
			return refusal{"create or change consumer " + name + " (filter " + filter + ")", subject, func(ctx context.Context, c *natsClient) error {
				cc := jetstream.ConsumerConfig{Durable: name, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: filter}
				_, err := c.js.CreateOrUpdateConsumer(ctx, cfg.Stream.Name, cc)
				return err
			}}
		}
		consumerDelete := func(name string) refusal {
			return refusal{"delete consumer " + name, "$JS.API.CONSUMER.DELETE.EVENTS." + name, raw("$JS.API.CONSUMER.DELETE.EVENTS."+name, ``)}
		}
		reset := func(name string) refusal {
			return refusal{"move consumer " + name, "$JS.API.CONSUMER.RESET.EVENTS." + name, func(ctx context.Context, c *natsClient) error {
				_, err := c.js.ResetConsumerToSequence(ctx, cfg.Stream.Name, name, 1)
				return err
			}}
		}
		otherThan := func(name string) string {
			if name == cacheinval.Name {
				return invoicing.Name
			}
			return cacheinval.Name
		}
		common := func() []refusal {
			return []refusal{
				update(cfg.Stream.Name), update(cfg.Subscribers.DeadLetterStream), create(cfg.Stream.Name),
				purge(cfg.Stream.Name), purge(cfg.Subscribers.DeadLetterStream),
				deleteStream(cfg.Stream.Name), deleteStream(cfg.Subscribers.DeadLetterStream),
				deleteMsg(cfg.Stream.Name), deleteMsg(cfg.Subscribers.DeadLetterStream),
			}
		}
		byUser := map[*natsClient][]refusal{}
		// The relay reads EVENTS by sequence (its database's newest
		// events, after a restore; the audit): events it wrote, whose rows
		// it reads.
		byUser[rel] = append(common(), getMsg(cfg.Subscribers.DeadLetterStream), directGet(cfg.Subscribers.DeadLetterStream),
			consumerCreate("snoop", ""), publishTo("deadletter.invoicing.x"))
		for c, d := range handlers {
			name := d.Name
			byUser[c] = append(common(), getMsg(cfg.Stream.Name), getMsg(cfg.Subscribers.DeadLetterStream), directGet(cfg.Stream.Name),
				// Not even its own consumer: it could widen its filter.
				consumerCreate(name, ""), consumerCreate(name, "events.>"), consumerDelete(name), reset(otherThan(name)),
				publishTo("events."+shop.OrderCreated))
		}
		byUser[prov] = []refusal{
			purge(cfg.Stream.Name), purge(cfg.Subscribers.DeadLetterStream),
			deleteStream(cfg.Stream.Name), deleteStream(cfg.Subscribers.DeadLetterStream),
			deleteMsg(cfg.Stream.Name), deleteMsg(cfg.Subscribers.DeadLetterStream),
			getMsg(cfg.Stream.Name), getMsg(cfg.Subscribers.DeadLetterStream), directGet(cfg.Stream.Name), consumerDelete(invoicing.Name),
			{"pull from consumer invoicing", "$JS.API.CONSUMER.MSG.NEXT.EVENTS." + invoicing.Name, raw("$JS.API.CONSUMER.MSG.NEXT.EVENTS."+invoicing.Name, `{"batch":1}`)},
			publishTo("events." + shop.OrderCreated), publishTo("deadletter.invoicing.x"),
		}
		// A replay is the subscriber's to carry out: the operator moves
		// no subscriber's consumer.
		byUser[op] = append(common(), publishTo("events."+shop.OrderCreated), publishTo("deadletter.invoicing.x"), reset(invoicing.Name), reset(searchindex.Name))
		for _, c := range append([]*natsClient{rel, prov, op}, slices.Collect(maps.Keys(handlers))...) {
			for _, r := range byUser[c] {
				c.deniedRequest(t, r.subject, func(ctx context.Context) error { return r.op(ctx, c) })
				t.Logf("refused: %-11s %s (%s)", c.user, r.what, r.subject)
			}
			c.checkClean(t)
		}
		// Not even the administrators may remove events or dead letters:
		// the streams themselves deny it.
		for name, admin := range map[string]*natsClient{cfg.Stream.Name: ns.connect(t, "admin"), cfg.Subscribers.DeadLetterStream: ns.connect(t, "admin_deadletter")} {
			s, err := admin.js.Stream(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Purge(ctx); err == nil {
				t.Errorf("admin purged %s", name)
			} else {
				t.Logf("refused: %-11s purge stream %s (the stream denies it: %v)", admin.user, name, err)
			}
			if err := s.DeleteMsg(ctx, 1); err == nil {
				t.Errorf("admin deleted a message of %s", name)
			} else {
				t.Logf("refused: %-11s delete a message of %s (the stream denies it: %v)", admin.user, name, err)
			}
		}
	})

	t.Run("a subscriber cannot publish events", func(t *testing.T) {
		before := eventCount()
		subject := "events." + shop.OrderCreated
		if err := inv.nc.Publish(subject, []byte(`{"order_id": 666}`)); err != nil {
			t.Fatal(err)
		}
		inv.waitViolation(t, "Publish", subject)
		inv.deniedRequest(t, subject, func(ctx context.Context) error {
			_, err := inv.js.Publish(ctx, subject, []byte(`{"order_id": 667}`))
			return err
		})
		for _, c := range []*natsClient{cin, six} {
			c.deniedRequest(t, "events.product.updated", func(ctx context.Context) error {
				_, err := c.js.Publish(ctx, "events.product.updated", []byte(`{"product_id": 1}`))
				return err
			})
		}
		if after := eventCount(); after != before {
			t.Errorf("stream %s went from %d to %d messages", cfg.Stream.Name, before, after)
		}
	})

	t.Run("a subscriber cannot touch another subscriber's consumer", func(t *testing.T) {
		other := "cacheinval"
		for _, c := range []*natsClient{inv, six} {
			events, err := c.js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				t.Fatal(err)
			}
			c.deniedRequest(t, "$JS.API.CONSUMER.INFO.EVENTS."+other, func(ctx context.Context) error {
				_, err := events.Consumer(ctx, other)
				return err
			})
			c.deniedRequest(t, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+other, func(ctx context.Context) error {
				_, err := c.nc.RequestWithContext(ctx, "$JS.API.CONSUMER.MSG.NEXT.EVENTS."+other, []byte(`{"batch":1}`))
				return err
			})
			c.deniedRequest(t, "$JS.API.CONSUMER.CREATE.EVENTS."+other, func(ctx context.Context) error {
				_, err := events.CreateOrUpdateConsumer(ctx, subscribers.ConsumerConfig(cacheinval.Name, cacheinval.Subscriber.EventTypes, false, cfg.Subscribers, cfg.Stream))
				return err
			})
			c.deniedRequest(t, "$JS.API.CONSUMER.DELETE.EVENTS."+other, func(ctx context.Context) error {
				return events.DeleteConsumer(ctx, other)
			})
			c.deniedRequest(t, "deadletter.cacheinval.product.updated", func(ctx context.Context) error {
				_, err := c.js.Publish(ctx, "deadletter.cacheinval.product.updated", []byte("{}"))
				return err
			})
			ackSubject := "$JS.ACK.EVENTS." + other + ".1.2.2.1700000000000000000.0"
			if err := c.nc.Publish(ackSubject, []byte("+ACK")); err != nil {
				t.Fatal(err)
			}
			c.waitViolation(t, "Publish", ackSubject)
			advisory := "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.EVENTS." + other
			sub, err := c.nc.Subscribe(advisory, func(*nats.Msg) {})
			if err != nil {
				t.Fatal(err)
			}
			c.waitViolation(t, "Subscription", advisory)
			_ = sub.Unsubscribe()
			c.deniedRequest(t, "$JS.API.STREAM.DELETE.EVENTS", func(ctx context.Context) error {
				return c.js.DeleteStream(ctx, cfg.Stream.Name)
			})
			c.checkClean(t)
		}
		// cacheinval's consumer delivered nothing to anyone.
		s, err := cin.js.Stream(ctx, cfg.Stream.Name)
		if err != nil {
			t.Fatal(err)
		}
		c, err := s.Consumer(ctx, other)
		if err != nil {
			t.Fatal(err)
		}
		if ci := c.CachedInfo(); ci.Delivered.Consumer != 0 || ci.NumPending != 1 {
			t.Errorf("cacheinval consumer: delivered %d, pending %d; want 0 and 1", ci.Delivered.Consumer, ci.NumPending)
		}
		cin.checkClean(t)
	})

	t.Run("no user can read or forge another user's replies", func(t *testing.T) {
		users := maps.Clone(client)
		users["relay"] = rel
		// request makes user receive a reply (a JetStream API response) on
		// its inbox.
		request := func(user string) {
			t.Helper()
			if _, err := users[user].js.Stream(ctx, cfg.Stream.Name); err != nil {
				t.Fatalf("%s looks up the stream: %v", user, err)
			}
		}
		// Replies stay in the requester's account: the administrator of
		// the stream's account, who may subscribe to anything there, sees
		// none of invoicing's.
		admin := ns.connect(t, "admin")
		seen := make(chan *nats.Msg, 100)
		spy, err := admin.nc.ChanSubscribe(">", seen)
		if err != nil {
			t.Fatal(err)
		}
		if err := admin.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		request("invoicing")
		if err := admin.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		for len(seen) > 0 {
			if m := <-seen; strings.HasPrefix(m.Subject, "_INBOX") {
				t.Errorf("the stream's administrator saw a reply on %s", m.Subject)
			}
		}
		_ = spy.Unsubscribe()

		// No other user may subscribe there, nor to the default inboxes,
		// nor publish (forge a reply) there.
		for user, c := range users {
			snooped := make(chan *nats.Msg, 100)
			subjects := []string{"_INBOX.>", ">"}
			for other := range users {
				if other != user {
					subjects = append(subjects, "_INBOX_"+other+".>")
				}
			}
			for _, subject := range subjects {
				sub, err := c.nc.ChanSubscribe(subject, snooped)
				if err != nil {
					t.Fatal(err)
				}
				defer sub.Unsubscribe() //nolint:errcheck
				c.waitViolation(t, "Subscription", subject)
			}
			for other := range users {
				if other == user {
					continue
				}
				request(other)
				forged := "_INBOX_" + other + ".forged"
				if err := c.nc.Publish(forged, []byte(`{"type":"io.nats.jetstream.api.v1.stream_info_response"}`)); err != nil {
					t.Fatal(err)
				}
				c.waitViolation(t, "Publish", forged)
			}
			if err := c.nc.Flush(); err != nil {
				t.Fatal(err)
			}
			select {
			case m := <-snooped:
				t.Errorf("%s read %s", user, m.Subject)
			default:
			}
			c.checkClean(t)
		}
	})
}
