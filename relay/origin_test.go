package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Two databases number their outbox rows from 1 alike. Their events must
// not be taken for each other's: a stream one database owns refuses the
// other's relay, and a stream shared on purpose holds every event of both.
// Anonymous (the sabotage hook: ids without their database, as before)
// shows the loss the test is there to catch.
func TestTwoDatabasesIntoOneStream(t *testing.T) {
	t.Parallel()
	const n = 50

	t.Run("a stream one database owns refuses another's relay", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		a := h.startRelay(nil, nil)
		writeMany(t, h.db.Pool, n)
		h.waitAllSent(n, 20*time.Second)

		info, err := a.js.Stream(context.Background(), h.cfg.Stream.Name)
		if err != nil {
			t.Fatal(err)
		}
		if owner := info.CachedInfo().Config.Metadata[stream.OwnerKey]; owner != h.identity().Database.String() {
			t.Fatalf("the stream records owner %q, want the relay's database %s", owner, h.identity().Database)
		}

		other := pgtest.NewDB(t)
		writeMany(t, other.Pool, n)
		hb := &harness{t: t, db: other, nats: h.nats, cfg: h.cfg}
		b := hb.newRelay(nil, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err = b.Start(ctx)
		if !errors.Is(err, ErrForeignStream) {
			_ = b.Stop(ctx)
			t.Fatalf("the relay of database %s started on a stream database %s owns: %v", hb.identity().Database, h.identity().Database, err)
		}
		t.Logf("refused: %v", err)
		if c := statusCounts(t, other.Pool); c["pending"] != n {
			t.Fatalf("the refused relay's rows: %s, want all %d pending", formatCounts(c), n)
		}
		if got := h.streamCount(); got != n {
			t.Fatalf("the stream holds %d events, want %d", got, n)
		}
	})

	shared := func(t *testing.T, hooks testhooks.Relay) (stored int, sent [2]int) {
		h := newHarness(t)
		h.cfg.Stream.Databases = stream.SeveralDatabases
		other := pgtest.NewDB(t)
		hb := &harness{t: t, db: other, nats: h.nats, cfg: h.cfg}
		for _, hh := range []*harness{h, hb} {
			r := hh.newRelay(nil, nil)
			r.hooks = hooks
			ctx, cancel := context.WithTimeout(testhooks.WithRelay(context.Background(), hooks), 10*time.Second)
			if err := r.Start(ctx); err != nil {
				t.Fatal(err)
			}
			cancel()
			t.Cleanup(func() { _ = r.Stop(context.Background()) })
			writeMany(t, hh.db.Pool, n)
			hh.waitAllSent(n, 20*time.Second)
		}
		return h.streamCount(), [2]int{statusCounts(t, h.db.Pool)["sent"], statusCounts(t, other.Pool)["sent"]}
	}
	t.Run("a shared stream holds both databases' events", func(t *testing.T) {
		t.Parallel()
		stored, sent := shared(t, testhooks.Relay{})
		if stored != 2*n || sent != [2]int{n, n} {
			t.Fatalf("the stream holds %d events of %v rows sent, want %d", stored, sent, 2*n)
		}
	})
	t.Run("sabotage: without their database the second one's events are dropped", func(t *testing.T) {
		t.Parallel()
		stored, sent := shared(t, testhooks.Relay{Anonymous: true, NoAudit: true})
		if stored != n || sent != [2]int{n, n} {
			t.Fatalf("the stream holds %d events of %v rows sent: the sabotage should lose the second database's %d", stored, sent, n)
		}
		t.Logf("sabotaged: %d rows sent in each database, %d events in the stream", n, stored)
	})
}

// A database restored from a base backup hands out again the ids of the
// events written after the backup, which the stream holds. The relay finds
// it and begins a new epoch at the first id the restored database wrote:
// every new event reaches the stream. The sabotage hook (no origin, no
// check) shows them dropped as duplicates.
func TestRestoreFromABaseBackup(t *testing.T) {
	t.Parallel()
	for _, capture := range []string{CapturePoll, CaptureWAL} {
		for _, variant := range []string{"", "live", "sabotage"} {
			name := capture
			if variant != "" {
				name += "/" + variant
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				restoreFromBackup(t, capture, variant == "sabotage", variant == "live")
			})
		}
	}
}

// restoreFromBackup writes, takes a base backup, writes the events the
// restore will lose, restores, and writes again. With live, one relay runs
// throughout, through the server's stop and start, as a deployed one would.
func restoreFromBackup(t *testing.T, capture string, sabotage, live bool) {
	const before, lost, after = 20, 100, 100
	server := pgtest.StartServer(t)
	h := newHarness(t)
	h.db = server.NewDB(t)
	h.cfg.Relay.Capture = capture
	hooks := testhooks.Relay{Anonymous: sabotage, NoAudit: sabotage} // as relays were before events carried their database
	obs := &rewindCounter{}
	run := func(writes func()) *Relay {
		r := h.newRelay(nil, obs)
		r.hooks = hooks
		r.wal.slotCheckEvery = 100 * time.Millisecond
		if !h.wal() {
			writes()
		}
		ctx, cancel := context.WithTimeout(testhooks.WithRelay(context.Background(), hooks), 30*time.Second)
		defer cancel()
		if err := r.Start(ctx); err != nil {
			t.Fatal(err)
		}
		if h.wal() {
			h.waitStreaming(r)
			writes()
		}
		return r
	}
	stop := func(r *Relay) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}

	r := run(func() { writeMany(t, h.db.Pool, before) })
	h.waitAllSent(before, 20*time.Second)
	backup, err := server.BaseBackup()
	if err != nil {
		t.Fatal(err)
	}
	writeMany(t, h.db.Pool, lost)
	h.waitAllSent(before+lost, 20*time.Second)
	if !live {
		stop(r)
	}
	lostIDs := maxID(t, h)

	if err := server.RestoreBackup(backup); err != nil {
		t.Fatal(err)
	}
	h.db.Pool.Reset()
	var last, rows int64
	if err := h.db.Pool.QueryRow(context.Background(), `SELECT fanout_outbox_last_id(), (SELECT count(*) FROM outbox)`).Scan(&last, &rows); err != nil {
		t.Fatal(err)
	}
	t.Logf("restored: %d rows, last id %d", rows, last)
	// The restored database writes as many events as it lost: the ids it
	// hands out again are ids of events the stream holds.
	if live {
		writeMany(t, h.db.Pool, after)
	} else {
		r = run(func() { writeMany(t, h.db.Pool, after) })
	}
	firstNew := firstWrittenAfter(t, h, before)
	want := before + lost + after
	if sabotage {
		if firstNew > lostIDs {
			t.Fatalf("the restored database wrote ids from %d, none of the lost ones (up to %d): the test shows nothing", firstNew, lostIDs)
		}
		// JetStream drops every new event whose id it has seen.
		want -= int(lostIDs - firstNew + 1)
	}
	// 90 s: alone the wal case takes 8 s; under the full suite's load (a
	// CI run at 7e6c86c) its live relay had not reconnected after the
	// restored server's start within 30.
	waitFor(t, 90*time.Second, fmt.Sprintf("%d events in the stream", want), func() (bool, string) {
		got := h.streamCount()
		return got == want && (h.wal() || statusCounts(t, h.db.Pool)["sent"] == before+after), fmt.Sprintf("%d in the stream, rows %s", got, formatCounts(statusCounts(t, h.db.Pool)))
	})
	stop(r)
	if sabotage {
		t.Logf("sabotaged: %d events the restored database wrote with ids %d..%d were dropped as duplicates", lostIDs-firstNew+1, firstNew, lostIDs)
		return
	}

	if n := obs.n.Load(); n != 1 {
		t.Fatalf("%d rewinds reported, want 1", n)
	}
	ident := h.identity()
	// The epoch begins after the rows the backup had, and at the restored
	// database's first row at the latest: in poll capture the relay found
	// the rewind after the writes, by the rows; in wal capture before
	// them, and moved the ids past the lost ones.
	if latest := ident.Latest(); latest.N != 2 || latest.FirstID <= before || latest.FirstID > firstNew {
		t.Fatalf("epochs %+v, want epoch 2 from an id in %d..%d", ident.Epochs, before+1, firstNew)
	}
	t.Logf("epoch 2 begins at id %d; the restored database wrote ids from %d, the lost ones were %d..%d", ident.Latest().FirstID, firstNew, before+1, lostIDs)
	newOrigin := outbox.Origin{Database: ident.Database, Epoch: 2}.String()
	got := map[string]int{}
	for _, m := range h.streamMessages() {
		id, _ := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
		o := m.Header.Get(wire.OriginHeader)
		if id >= firstNew && o == newOrigin {
			got["new"]++
		}
		if m.Header.Get("Nats-Msg-Id") != o+":"+strconv.FormatInt(id, 10) {
			t.Fatalf("message %d: Nats-Msg-Id %q, origin %q", id, m.Header.Get("Nats-Msg-Id"), o)
		}
	}
	if got["new"] != after {
		t.Fatalf("%d events of epoch 2 in the stream, want the %d the restored database wrote", got["new"], after)
	}
}

// rewindCounter counts the rewinds a relay reports.
type rewindCounter struct {
	NopObserver
	n atomic.Int32
}

func (c *rewindCounter) Rewound() { c.n.Add(1) }

// maxID is the outbox's greatest id.
func maxID(t *testing.T, h *harness) int64 {
	t.Helper()
	var id int64
	if err := h.db.Pool.QueryRow(context.Background(), `SELECT max(id) FROM outbox`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// firstWrittenAfter is the least id of the rows the restored database
// wrote, after the first rows that it had from the backup.
func firstWrittenAfter(t *testing.T, h *harness, backedUp int) int64 {
	t.Helper()
	var id int64
	if err := h.db.Pool.QueryRow(context.Background(), `
SELECT min(id) FROM outbox
WHERE created_at > (SELECT max(created_at) FROM (SELECT created_at FROM outbox ORDER BY id LIMIT $1) AS b)`, backedUp).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// publishForeign stores an event with the given origin and id in the
// harness's stream, as another relay would have.
func publishForeign(t *testing.T, h *harness, origin string, id int64) {
	t.Helper()
	js, err := jetstream.New(h.connect())
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(stream.Subject(h.cfg.Stream.SubjectPrefix, "thing.made"))
	m.Data = []byte(`{}`)
	m.Header.Set(wire.EventIDHeader, strconv.FormatInt(id, 10))
	m.Header.Set(wire.OriginHeader, origin)
	m.Header.Set(wire.EventTypeHeader, "thing.made")
	m.Header.Set(wire.AggregateTypeHeader, "thing")
	m.Header.Set(wire.AggregateIDHeader, "1")
	m.Header.Set(wire.CreatedAtHeader, time.Now().UTC().Format(time.RFC3339Nano))
	if _, err := js.PublishMsg(context.Background(), m, jetstream.WithMsgID(wire.MsgID(origin, id))); err != nil {
		t.Fatal(err)
	}
}

// The stream holds an event of an epoch of this database that its outbox
// does not know (a clone with the same identity publishing, or a restore
// from a backup older than that epoch): the relay does not guess. It
// publishes nothing, is not ready, and says which statement begins the
// next epoch; once an operator runs it, the rows go.
func TestAnEpochTheOutboxDoesNotKnow(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r := h.startRelay(nil, nil)
	writeMany(t, h.db.Pool, 5)
	h.waitAllSent(5, 20*time.Second)
	ident := h.identity()
	publishForeign(t, h, outbox.Origin{Database: ident.Database, Epoch: 2}.String(), 3)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	writeMany(t, h.db.Pool, 5)
	r = h.startRelay(nil, nil)
	var why string
	waitFor(t, 20*time.Second, "the relay refusing the unknown epoch", func() (bool, string) {
		err := r.Ready()
		if err != nil && errors.Is(err, ErrUnknownEpoch) {
			why = err.Error()
			return true, ""
		}
		return false, fmt.Sprintf("ready: %v", err)
	})
	t.Logf("not ready: %s", why)
	if c := statusCounts(t, h.db.Pool); c["sent"] != 5 {
		t.Fatalf("rows %s, want only the first 5 sent", formatCounts(c))
	}
	i := strings.Index(why, "SELECT fanout_outbox_new_epoch(")
	if i < 0 {
		t.Fatalf("the refusal names no statement to begin the next epoch: %s", why)
	}
	if _, err := h.db.Pool.Exec(context.Background(), why[i:]); err != nil {
		t.Fatalf("the statement the refusal names: %v", err)
	}
	h.waitAllSent(10, 20*time.Second)
	if err := r.Ready(); err != nil {
		t.Fatalf("after the epoch began: not ready: %v", err)
	}
	if latest := h.identity().Latest(); latest.N != 3 || latest.FirstID != 11 {
		t.Fatalf("epochs %+v, want epoch 3 from id 11 (the rows written before it keep epoch 1)", h.identity().Epochs)
	}
}

// A stream that records no owner (made by `fanout provision` without
// stream.database) and whose newest event is another database's is not
// taken over by a relay with stream.provision auto.
func TestAnAutoRelayLeavesAnotherDatabasesStream(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	js, err := jetstream.New(h.connect())
	if err != nil {
		t.Fatal(err)
	}
	cfg := stream.JetStreamConfig(h.cfg.Stream)
	delete(cfg.Metadata, stream.OwnerKey)
	if _, err := js.CreateStream(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	other := outbox.Database{System: h.identity().Database.System, Name: "another shop"}
	publishForeign(t, h, outbox.Origin{Database: other, Epoch: 1}.String(), 1)

	r := h.newRelay(nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Start(ctx); !errors.Is(err, ErrForeignStream) {
		_ = r.Stop(ctx)
		t.Fatalf("a relay with stream.provision auto started on a stream whose newest event is another database's: %v", err)
	}
	s, err := js.Stream(ctx, cfg.Name)
	if err != nil {
		t.Fatal(err)
	}
	if owner := s.CachedInfo().Config.Metadata[stream.OwnerKey]; owner != "" {
		t.Fatalf("the refused relay recorded owner %q", owner)
	}
}
