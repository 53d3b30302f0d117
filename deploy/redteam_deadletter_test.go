package deploy_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
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
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The production configuration's share of the store for DEADLETTER's
// account, and the share the test gives it instead so that it fills in a
// moment (the mechanism is the same).
const (
	deadLetterShare     = "jetstream: {max_file: 2GB}"
	deadLetterTestShare = "jetstream: {max_file: 256KB}"
)

// TestRedTeamDeadLettersCannotFillTheStore attacks the store as a
// subscriber's credential: it publishes dead letters without end (it may:
// deadletter.invoicing.>). Under the production configuration, its
// account's share shrunk to 256KB, its letters are refused once the share
// is full, and so are another subscriber's (the share is every
// subscriber's), while the relay publishes into EVENTS more than the whole
// share. Against the configuration without the share, the same letters
// went on past it: the store the relay needs was the subscriber's to fill.
func TestRedTeamDeadLettersCannotFillTheStore(t *testing.T) {
	t.Parallel()
	prod, err := os.ReadFile(natsConfPath(t))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Count(string(prod), deadLetterShare) != 1 {
		t.Fatalf("the production configuration holds %q %d times, want once: the test no longer shrinks what production sets", deadLetterShare, strings.Count(string(prod), deadLetterShare))
	}
	const letter = 4 << 10
	for _, tc := range []struct {
		name, share string
		bounded     bool
	}{
		{"production", deadLetterTestShare, true},
		{"without-a-share", "jetstream: enabled", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conf := filepath.Join(t.TempDir(), "nats-server.conf")
			if err := os.WriteFile(conf, []byte(strings.Replace(string(prod), deadLetterShare, tc.share, 1)), 0o600); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cfg := loadConfig(t)
			ns := startNATSWith(t, conf, natsUsers)
			discard := slog.New(slog.NewTextHandler(io.Discard, nil))
			rel, prov := ns.connect(t, "relay"), ns.connect(t, "provisioner")
			inv, cin := ns.connect(t, invoicing.Name), ns.connect(t, cacheinval.Name)
			if err := stream.Ensure(ctx, prov.js, cfg.Stream, relay.RepublishDelay(cfg.Relay), discard); err != nil {
				t.Fatalf("provision the stream: %v", err)
			}
			if _, err := subscribers.ProvisionDeadLetterStream(ctx, prov.js, cfg.Subscribers, cfg.Stream.Replicas, stream.Changes{}, discard); err != nil {
				t.Fatalf("provision the dead-letter stream: %v", err)
			}

			// 512KB of letters: twice the share.
			body := []byte(`{"pad": "` + strings.Repeat("x", letter) + `"}`)
			stored, refusal := 0, error(nil)
			for i := range 128 {
				_, err := inv.js.Publish(ctx, "deadletter.invoicing."+shop.OrderCreated, body, jetstream.WithMsgID("flood-"+strconv.Itoa(i)))
				if err != nil {
					refusal = err
					break
				}
				stored++
			}
			if !tc.bounded {
				if refusal != nil || stored != 128 {
					t.Fatalf("without a share: %d letters stored, then %v; want all 128 (the attack this share stops)", stored, refusal)
				}
				t.Logf("without a share the subscriber stored %d letters of %d bytes: past any share", stored, len(body))
				return
			}
			if refusal == nil || stored*len(body) > 256<<10 {
				t.Fatalf("the subscriber stored %d letters of %d bytes (%v), want refused within the 256KB share", stored, len(body), refusal)
			}
			t.Logf("refused after %d letters (%d bytes): %v", stored, stored*len(body), refusal)
			// What a subscriber reads of the share before it is full
			// (subscribers.dead_letter_api_prefix, as compose sets it).
			shareJS, err := jetstream.NewWithAPIPrefix(inv.nc, "$JS.DEADLETTER.API")
			if err != nil {
				t.Fatal(err)
			}
			share, err := shareJS.AccountInfo(ctx)
			if err != nil || share.Limits.MaxStore != 256<<10 || share.Store < uint64(stored*len(body)) {
				t.Fatalf("the share as invoicing reads it: %+v (%v), want the 256KB limit and at least the %d bytes stored", share, err, stored*len(body))
			}
			if _, err := cin.js.Publish(ctx, "deadletter.cacheinval.product.updated", body, jetstream.WithMsgID("other")); err == nil {
				t.Errorf("another subscriber's letter was stored in a full share")
			}
			// The relay publishes into EVENTS twice the whole share.
			for i := range 128 {
				msg := nats.NewMsg("events." + shop.OrderCreated)
				msg.Data = body
				msg.Header.Set(wire.EventIDHeader, strconv.Itoa(i+1))
				if _, err := rel.js.PublishMsg(ctx, msg, jetstream.WithMsgID(strconv.Itoa(i+1))); err != nil {
					t.Fatalf("the relay's event %d refused with the dead letters' share full: %v", i+1, err)
				}
			}
			if got := streamMessages(t, ns); got[cfg.Stream.Name] != 128 || got[cfg.Subscribers.DeadLetterStream] != uint64(stored) {
				t.Errorf("streams hold %v, want %d events and %d letters", got, 128, stored)
			}
		})
	}
}
