package subscribers

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

type shareObserver struct {
	NopObserver
	mu          sync.Mutex
	used, limit int64
}

func (o *shareObserver) DeadLetterShare(_ string, used, limit int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.used, o.limit = used, limit
}

// A share of the store (an account's max_file, as DEADLETTER's in the
// production layout) read on a real server: its use and limit reported,
// one warning when it passes 80%, none again while it stays there, and a
// line when it has room again.
func TestDeadLetterShareWarnsBeforeItIsFull(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "share.conf")
	if err := os.WriteFile(conf, []byte("accounts {\n  DL: {jetstream: {max_file: 64KB}, users: [{user: dl, password: dl}]}\n}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ns := natstest.Start(t, natstest.WithArgs("-c", conf), natstest.WithClientOptions(nats.UserInfo("dl", "dl")))
	nc, err := nats.Connect(ns.URL, nats.UserInfo("dl", "dl"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DL", Subjects: []string{"dl.>"}, Storage: jetstream.FileStorage})
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	obs := &shareObserver{}
	share, err := newDeadLetterShare(nc, "$JS.API", "invoicing", obs, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	warnings := func() int { return strings.Count(logs.String(), "share of the store is filling") }

	share.check(ctx)
	if obs.limit != 64<<10 || warnings() != 0 {
		t.Fatalf("an empty share: used %d, limit %d, %d warnings; want the limit 65536 and no warning", obs.used, obs.limit, warnings())
	}
	letter := bytes.Repeat([]byte("x"), 4<<10)
	for obs.used < 56<<10 {
		if _, err := js.Publish(ctx, "dl.invoicing.x", letter); err != nil {
			t.Fatalf("a letter at %d bytes used: %v", obs.used, err)
		}
		share.check(ctx)
	}
	share.check(ctx)
	if warnings() != 1 {
		t.Fatalf("a share %d of %d bytes full: %d warnings, want one\n%s", obs.used, obs.limit, warnings(), logs.String())
	}
	if err := s.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	share.check(ctx)
	if !strings.Contains(logs.String(), "has room again") || obs.used >= 56<<10 {
		t.Fatalf("after a purge: used %d\n%s\nwant the share's room said", obs.used, logs.String())
	}
}
