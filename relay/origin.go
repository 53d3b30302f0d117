package relay

// Every event knows its database (DESIGN.md, invariant 10). The relay
// reads the database's identity and the outbox's epochs at start, stamps
// every message with its origin (Fanout-Origin, and Nats-Msg-Id
// "<origin>:<id>"), refuses a stream another database owns, and finds a
// restore that rewound the outbox's ids before it publishes anything the
// restored database wrote.
//
// A restore from a backup takes the database back to the backup's point:
// the outbox then hands out again ids the stream already holds events for
// (the events written after the backup, which the database lost). Under
// the same identity, JetStream would drop the new events as duplicates
// inside its duplicates window, and the subscribers' checkpoints would skip
// them after it. The stream remembers what the database forgot: the newest
// event of this database in the stream has an id the outbox has not handed
// out yet, or its row now holds another event. Then the relay begins a new
// epoch at the first id the restored database wrote, and every event from
// there on has a new identity.
//
// The check runs before the first publish, after any error that may mean
// Postgres went away (a restore stops it), when the server's start time
// changes (read before every batch: a pool that replaced its connections
// quietly, a failover, a proxy in between), and every
// stream.check_interval. It compares the outbox with the newest events of
// this database in the stream's tail: an id the outbox has not handed out
// yet, or a row that now holds another event, or is gone although the
// event is younger than relay.sent_retention, is a rewind. An epoch of
// this database the outbox does not know is not taken for a rewind: the
// relay stops publishing and says why (another copy of the database
// publishes into the stream, or a backup older than that epoch was
// restored), since beginning yet another epoch could give rows already
// published a second identity.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go/jetstream"
)

// originGuard keeps the database's identity, which every message carries,
// and holds publishing back while the stream is another database's or a
// restore may have rewound the outbox's ids.
type originGuard struct {
	*core
	// identity is the database's identity and its outbox's epochs.
	identity atomic.Pointer[outbox.Identity]
	// want is bumped to ask for a rewind check before the next publish,
	// done is the request the last check answered; pgStarted is the
	// Postgres start time last seen (unix nanoseconds). foreign stops
	// publishing into a stream another database owns, conflict while the
	// stream holds an epoch the outbox does not know.
	want, done atomic.Uint64
	pgStarted  atomic.Int64
	foreign    atomic.Bool
	conflict   atomic.Pointer[string]
	rewindMu   sync.Mutex
}

// load reads the database's identity, waiting out an outage of
// Postgres.
func (o *originGuard) load(ctx context.Context) error {
	op := func() (struct{}, error) {
		ident, err := o.store.ReadIdentity(ctx)
		if err != nil {
			return struct{}{}, err
		}
		o.identity.Store(ident)
		return struct{}{}, nil
	}
	if _, err := backoff.Retry(ctx, op,
		backoff.WithBackOff(backoff.NewExponentialBackOff()),
		backoff.WithMaxElapsedTime(0),
		backoff.WithNotify(func(err error, next time.Duration) {
			o.logger.Warn("read the database's identity: retrying", "error", err, "retry_in", next)
		})); err != nil {
		return err
	}
	ident := o.identity.Load()
	o.logger.Info("database identity", "database", ident.Database.String(), "epoch", ident.Latest().N)
	return nil
}

// ErrForeignStream is the error of a relay whose stream another database owns.
var ErrForeignStream = errors.New("the stream belongs to another database")

// claimUnowned refuses, before a relay with stream.provision auto records
// its database as the owner of a stream that records none, a stream whose
// newest event is another database's.
func (o *originGuard) claimUnowned(ctx context.Context) error {
	s, err := o.js.Stream(ctx, o.stream.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read stream %s's owner: %w", o.stream.Name, err)
	}
	if s.CachedInfo().Config.Metadata[stream.OwnerKey] != "" {
		return nil
	}
	if err := o.newestIsOurs(ctx, s); err != nil {
		o.foreign.Store(true)
		return fmt.Errorf("%w: %v", ErrForeignStream, err)
	}
	return nil
}

// newestIsOurs refuses a stream that records no owner but whose newest
// event is another database's.
func (o *originGuard) newestIsOurs(ctx context.Context, s jetstream.Stream) error {
	info := s.CachedInfo()
	own := o.identity.Load().Database.String()
	if o.stream.Databases == stream.SeveralDatabases || info.State.Msgs == 0 {
		return nil
	}
	m, err := s.GetMsg(ctx, info.State.LastSeq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read stream %s's newest event: %w", o.stream.Name, err)
	}
	if theirs, perr := outbox.ParseOrigin(m.Header.Get(wire.OriginHeader)); perr == nil && theirs.Database.String() != own {
		return fmt.Errorf("stream %s records no owner, but its newest event (sequence %d) is database %s's, not this relay's database %s: "+
			"give this database a stream of its own (stream.name, stream.subject_prefix), or share one on purpose (stream.databases several)",
			o.stream.Name, info.State.LastSeq, theirs.Database, own)
	}
	return nil
}

// checkOwner refuses a stream that records another database as its owner
// (stream metadata stream.OwnerKey), unless it is shared
// (stream.databases several).
func (o *originGuard) checkOwner(ctx context.Context) error {
	if o.stream.Provision == "off" {
		return nil
	}
	s, err := o.js.Stream(ctx, o.stream.Name)
	if err != nil {
		return fmt.Errorf("read stream %s's owner: %w", o.stream.Name, err)
	}
	info := s.CachedInfo()
	own := o.identity.Load().Database.String()
	err = stream.CheckOwner(info.Config, o.stream, own)
	if errors.Is(err, stream.ErrNoOwner) {
		// A stream `fanout provision` made without stream.database: its
		// events say whose it is, the newest one last.
		err = o.newestIsOurs(ctx, s)
		if err == nil {
			o.logger.Info("the stream records no owning database in its metadata; its events are this database's", "stream", o.stream.Name,
				"database", own)
			o.foreign.Store(false)
			return nil
		}
	}
	if err != nil {
		o.foreign.Store(true)
		return fmt.Errorf("%w: %v", ErrForeignStream, err)
	}
	o.foreign.Store(false)
	return nil
}

// tailEvent is one event of this database in the stream's tail.
type tailEvent struct {
	seq       uint64
	origin    outbox.Origin
	id        int64
	createdAt string
	eventType string
	aggregate string
}

// tailScan is how many of the stream's newest messages the restore check
// reads: ids are handed out in one order and committed in another (and a
// wal relay publishes in commit order), so the highest id of the newest
// events is looked for among many, not taken from the last.
const tailScan = 1000

// tail reads this database's events among the stream's newest messages.
func (o *originGuard) tail(ctx context.Context, db outbox.Database) ([]tailEvent, error) {
	s, err := o.js.Stream(ctx, o.stream.Name)
	if err != nil {
		return nil, err
	}
	state := s.CachedInfo().State
	if state.Msgs == 0 {
		return nil, nil
	}
	n := tailScan
	if !s.CachedInfo().Config.AllowDirect {
		n = slowRead
	}
	from := uint64(1)
	if state.LastSeq > uint64(n) {
		from = state.LastSeq - uint64(n) + 1
	}
	prefix := db.String() + "/"
	var out []tailEvent
	err = readStream(ctx, o.js, s, from, n, func(m *jetstream.RawStreamMsg) bool {
		raw := m.Header.Get(wire.OriginHeader)
		if !strings.HasPrefix(raw, prefix) {
			return true
		}
		origin, err := outbox.ParseOrigin(raw)
		if err != nil {
			return true
		}
		id, err := strconv.ParseInt(m.Header.Get(wire.EventIDHeader), 10, 64)
		if err != nil {
			return true
		}
		out = append(out, tailEvent{seq: m.Sequence, origin: origin, id: id, createdAt: m.Header.Get(wire.CreatedAtHeader),
			eventType: m.Header.Get(wire.EventTypeHeader),
			aggregate: m.Header.Get(wire.AggregateTypeHeader) + "/" + m.Header.Get(wire.AggregateIDHeader)})
		return true
	})
	return out, err
}

// ErrUnknownEpoch is the error of a relay whose stream holds events of an
// epoch of its database that the outbox does not know.
var ErrUnknownEpoch = errors.New("the stream holds events of an outbox epoch this database does not know")

// checkRewind answers the rewind check asked for as generation want: it
// compares the outbox with this database's newest events in the stream,
// and begins a new epoch if a restore rewound the ids. One check runs at a
// time, and a check that began at or after the request answers it: every
// batch waiting on a due check (after an outage, hundreds of them) goes
// on the next check's answer rather than each running its own in turn.
func (o *originGuard) checkRewind(ctx context.Context, want uint64) error {
	o.rewindMu.Lock()
	defer o.rewindMu.Unlock()
	if o.done.Load() >= want {
		return nil
	}
	if err := o.compareWithStream(ctx); err != nil {
		return err
	}
	// Done up to the generation asked for when the check began: a request
	// made during it asks for another.
	for {
		done := o.done.Load()
		if done >= want || o.done.CompareAndSwap(done, want) {
			return nil
		}
	}
}

// compareWithStream is checkRewind's comparison, under rewindMu.
func (o *originGuard) compareWithStream(ctx context.Context) error {
	// The stream's tail first, then the outbox: an event the tail holds
	// was published, so its id handed out, before the last id is read
	// (read the other way round, the relays' newest publishes would look
	// like ids the outbox never handed out). The identity and the last id
	// are read together: after another relay began an epoch for this
	// rewind, both say so.
	db, err := outbox.ReadDatabase(ctx, o.pool)
	if err != nil {
		return err
	}
	events, err := o.tail(ctx, db)
	if err != nil {
		return fmt.Errorf("read the newest events of this database in stream %s: %w", o.stream.Name, err)
	}
	ident, lastID, err := o.store.State(ctx)
	if err != nil {
		return err
	}
	o.identity.Store(ident)
	newest, err := o.newestOfLatestEpoch(events, ident, lastID)
	if err != nil || newest == nil {
		return err // none of the current epoch: published before it began
	}
	why, err := o.rewound(ctx, newest, lastID)
	if err != nil || why == "" {
		return err
	}
	return o.beginEpoch(ctx, ident, newest, lastID, highestID(events), why)
}

// newestOfLatestEpoch is the newest event of the outbox's latest epoch
// among events, or nil; an event of an epoch the outbox does not know is
// a conflict, and publishing stops (see originGuard).
func (o *originGuard) newestOfLatestEpoch(events []tailEvent, ident *outbox.Identity, lastID int64) (*tailEvent, error) {
	latest := ident.Latest()
	var newest *tailEvent
	for i, e := range events {
		if e.origin.Epoch > latest.N {
			why := fmt.Sprintf("stream %s holds event %d of epoch %d of database %s (sequence %d), but the outbox knows epochs up to %d only: "+
				"another copy of this database (a clone or a promoted standby, with the same system identifier and name) publishes into this stream, "+
				"or the database was restored from a backup older than epoch %d. Not publishing. When you know it is a restore, begin the next epoch "+
				"(as fanout_migrate or the relay's role): SELECT fanout_outbox_new_epoch(%d, %d, %d, %d, 'restored from a backup older than epoch %d')",
				o.stream.Name, e.id, e.origin.Epoch, ident.Database, e.seq, latest.N, e.origin.Epoch,
				latest.N, e.origin.Epoch+1, lastID+1, highestID(events), e.origin.Epoch)
			o.conflict.Store(&why)
			return nil, fmt.Errorf("%w: %s", ErrUnknownEpoch, why)
		}
		if e.origin.Epoch == latest.N && (newest == nil || e.id > newest.id) {
			newest = &events[i]
		}
	}
	o.conflict.Store(nil)
	return newest, nil
}

// rewound says why the outbox no longer holds the stream's newest event
// as it was published ("" if it does): an id not handed out yet, a row
// gone although younger than retention, or a row that is another event.
func (o *originGuard) rewound(ctx context.Context, newest *tailEvent, lastID int64) (string, error) {
	if newest.id > lastID {
		return fmt.Sprintf("the stream holds event %d (sequence %d), but the outbox has handed out ids up to %d only",
			newest.id, newest.seq, lastID), nil
	}
	row, ok, err := o.store.Event(ctx, newest.id)
	if err != nil {
		return "", err
	}
	if !ok {
		created, perr := time.Parse(time.RFC3339Nano, newest.createdAt)
		if perr != nil {
			return "", nil
		}
		recent, err := o.store.RecentlyCreated(ctx, created, o.cfg.SentRetention)
		if err != nil || !recent {
			return "", err
		}
		// Retention drops a row only relay.sent_retention after its
		// publish, and a rolled-back id was never published.
		return fmt.Sprintf("the stream holds event %d (sequence %d, created %s), whose outbox row is gone, although no row that young is dropped (relay.sent_retention %s)",
			newest.id, newest.seq, newest.createdAt, o.cfg.SentRetention), nil
	}
	if created := row.CreatedAt.Time.UTC().Format(time.RFC3339Nano); created != newest.createdAt ||
		row.EventType != newest.eventType || row.AggregateType+"/"+row.AggregateID != newest.aggregate {
		return fmt.Sprintf("the stream holds event %d (sequence %d: %s of %s, created %s), but outbox row %d is %s of %s/%s, created %s",
			newest.id, newest.seq, newest.eventType, newest.aggregate, newest.createdAt,
			row.ID, row.EventType, row.AggregateType, row.AggregateID, created), nil
	}
	return "", nil
}

// beginEpoch begins the epoch of a restored database, at the first id it
// wrote after the restore (newest is the stream's newest event of the
// outbox's latest epoch, which the outbox lost), and takes the new
// identity.
func (o *originGuard) beginEpoch(ctx context.Context, ident *outbox.Identity, newest *tailEvent, lastID, highest int64, why string) error {
	latest := ident.Latest()
	created, err := time.Parse(time.RFC3339Nano, newest.createdAt)
	if err != nil {
		created = time.Now() // every row older than now is taken as the backup's
	}
	firstID, err := o.store.RewoundFrom(ctx, newest.id, created, lastID, latest.FirstID)
	if err != nil {
		return err
	}
	reason := "the outbox's ids were rewound (a restore from a backup?): " + why
	epoch, err := o.store.NewEpoch(ctx, latest.N, latest.N+1, firstID, highest, reason)
	if err != nil {
		return err
	}
	o.obs.Rewound()
	o.logger.Error("the database was restored to an earlier point: its outbox's ids were rewound; "+
		"its new events begin a new epoch, and the stream's events of the lost ids are no longer in the database",
		"database", ident.Database.String(), "detail", why, "epoch", epoch, "epoch_first_id", firstID,
		"lost_ids", fmt.Sprintf("%d..%d", firstID, newest.id))
	ident, err = o.store.ReadIdentity(ctx)
	if err != nil {
		return err
	}
	o.identity.Store(ident)
	return nil
}

// highestID is the highest id among events.
func highestID(events []tailEvent) int64 {
	var m int64
	for _, e := range events {
		m = max(m, e.id)
	}
	return m
}

// markStale asks for a rewind check before the next publish.
func (o *originGuard) markStale() { o.want.Add(1) }

// guard runs the rewind check when one is due, before a batch is
// published; an error holds the batch back (it is retried).
func (o *originGuard) guard(ctx context.Context) error {
	if o.foreign.Load() {
		return fmt.Errorf("%w: not publishing (see the relay's log)", ErrForeignStream)
	}
	if o.hooks.Anonymous {
		return nil
	}
	// A restore, a failover or a restart of Postgres changes its start
	// time, whether or not a query of this relay's failed meanwhile.
	started, err := o.store.PostgresStarted(ctx)
	if err != nil {
		o.markStale()
		return fmt.Errorf("check the outbox against the stream (a restore?): %w", err)
	}
	if prev := o.pgStarted.Swap(started.UnixNano()); prev != started.UnixNano() {
		o.markStale()
	}
	want := o.want.Load()
	if o.done.Load() >= want {
		return nil
	}
	if err := o.checkRewind(ctx, want); err != nil {
		return fmt.Errorf("check the outbox against the stream (a restore?): %w", err)
	}
	return nil
}

// recheck is the periodic part: owner and rewind, with the stream check.
func (o *originGuard) recheck(ctx context.Context) {
	if err := o.checkOwner(ctx); err != nil {
		o.logger.Error("not publishing", "error", err)
	}
	o.markStale()
}

// blocked says why the relay does not publish, if it is the stream's
// owner or an unknown epoch (readiness).
func (o *originGuard) blocked() error {
	if o.foreign.Load() {
		return fmt.Errorf("%w: not publishing (see the relay's log)", ErrForeignStream)
	}
	if why := o.conflict.Load(); why != nil {
		return fmt.Errorf("%w: %s", ErrUnknownEpoch, *why)
	}
	return nil
}
