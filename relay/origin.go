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
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go/jetstream"
)

// loadIdentity reads the database's identity, waiting out an outage of
// Postgres.
func (r *Relay) loadIdentity(ctx context.Context) error {
	op := func() (struct{}, error) {
		ident, err := r.store.ReadIdentity(ctx)
		if err != nil {
			return struct{}{}, err
		}
		r.identity.Store(ident)
		return struct{}{}, nil
	}
	if _, err := backoff.Retry(ctx, op,
		backoff.WithBackOff(backoff.NewExponentialBackOff()),
		backoff.WithMaxElapsedTime(0),
		backoff.WithNotify(func(err error, next time.Duration) {
			r.logger.Warn("read the database's identity: retrying", "error", err, "retry_in", next)
		})); err != nil {
		return err
	}
	ident := r.identity.Load()
	r.logger.Info("database identity", "database", ident.Database.String(), "epoch", ident.Latest().N)
	return nil
}

// ErrForeignStream is the error of a relay whose stream another database owns.
var ErrForeignStream = errors.New("the stream belongs to another database")

// claimUnowned refuses, before a relay with stream.provision auto records
// its database as the owner of a stream that records none, a stream whose
// newest event is another database's.
func (r *Relay) claimUnowned(ctx context.Context) error {
	s, err := r.js.Stream(ctx, r.stream.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read stream %s's owner: %w", r.stream.Name, err)
	}
	if s.CachedInfo().Config.Metadata[stream.OwnerKey] != "" {
		return nil
	}
	if err := r.newestIsOurs(ctx, s); err != nil {
		r.foreign.Store(true)
		return fmt.Errorf("%w: %v", ErrForeignStream, err)
	}
	return nil
}

// newestIsOurs refuses a stream that records no owner but whose newest
// event is another database's.
func (r *Relay) newestIsOurs(ctx context.Context, s jetstream.Stream) error {
	info := s.CachedInfo()
	own := r.identity.Load().Database.String()
	if r.stream.Databases == stream.SeveralDatabases || info.State.Msgs == 0 {
		return nil
	}
	m, err := s.GetMsg(ctx, info.State.LastSeq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read stream %s's newest event: %w", r.stream.Name, err)
	}
	if o, perr := outbox.ParseOrigin(m.Header.Get(outbox.OriginHeader)); perr == nil && o.Database.String() != own {
		return fmt.Errorf("stream %s records no owner, but its newest event (sequence %d) is database %s's, not this relay's database %s: "+
			"give this database a stream of its own (stream.name, stream.subject_prefix), or share one on purpose (stream.databases several)",
			r.stream.Name, info.State.LastSeq, o.Database, own)
	}
	return nil
}

// checkOwner refuses a stream that records another database as its owner
// (stream metadata stream.OwnerKey), unless it is shared
// (stream.databases several).
func (r *Relay) checkOwner(ctx context.Context) error {
	if r.stream.Provision == "off" {
		return nil
	}
	s, err := r.js.Stream(ctx, r.stream.Name)
	if err != nil {
		return fmt.Errorf("read stream %s's owner: %w", r.stream.Name, err)
	}
	info := s.CachedInfo()
	own := r.identity.Load().Database.String()
	err = stream.CheckOwner(info.Config, r.stream, own)
	if errors.Is(err, stream.ErrNoOwner) {
		// A stream `fanout provision` made without stream.database: its
		// events say whose it is, the newest one last.
		err = r.newestIsOurs(ctx, s)
		if err == nil {
			r.logger.Info("the stream records no owning database in its metadata; its events are this database's", "stream", r.stream.Name,
				"database", own)
			r.foreign.Store(false)
			return nil
		}
	}
	if err != nil {
		r.foreign.Store(true)
		return fmt.Errorf("%w: %v", ErrForeignStream, err)
	}
	r.foreign.Store(false)
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
func (r *Relay) tail(ctx context.Context, db outbox.Database) ([]tailEvent, error) {
	s, err := r.js.Stream(ctx, r.stream.Name)
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
	err = readStream(ctx, r.js, s, from, n, func(m *jetstream.RawStreamMsg) bool {
		o := m.Header.Get(outbox.OriginHeader)
		if !strings.HasPrefix(o, prefix) {
			return true
		}
		origin, err := outbox.ParseOrigin(o)
		if err != nil {
			return true
		}
		id, err := strconv.ParseInt(m.Header.Get(outbox.EventIDHeader), 10, 64)
		if err != nil {
			return true
		}
		out = append(out, tailEvent{seq: m.Sequence, origin: origin, id: id, createdAt: m.Header.Get(outbox.CreatedAtHeader),
			eventType: m.Header.Get(outbox.EventTypeHeader),
			aggregate: m.Header.Get(outbox.AggregateTypeHeader) + "/" + m.Header.Get(outbox.AggregateIDHeader)})
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
func (r *Relay) checkRewind(ctx context.Context, want uint64) error {
	r.rewindMu.Lock()
	defer r.rewindMu.Unlock()
	if r.originDone.Load() >= want {
		return nil
	}
	if err := r.compareWithStream(ctx); err != nil {
		return err
	}
	// Done up to the generation asked for when the check began: a request
	// made during it asks for another.
	for {
		done := r.originDone.Load()
		if done >= want || r.originDone.CompareAndSwap(done, want) {
			return nil
		}
	}
}

// compareWithStream is checkRewind's comparison, under rewindMu.
func (r *Relay) compareWithStream(ctx context.Context) error {
	// The stream's tail first, then the outbox: an event the tail holds
	// was published, so its id handed out, before the last id is read
	// (read the other way round, the relays' newest publishes would look
	// like ids the outbox never handed out). The identity and the last id
	// are read together: after another relay began an epoch for this
	// rewind, both say so.
	db, err := outbox.ReadDatabase(ctx, r.pool)
	if err != nil {
		return err
	}
	events, err := r.tail(ctx, db)
	if err != nil {
		return fmt.Errorf("read the newest events of this database in stream %s: %w", r.stream.Name, err)
	}
	ident, lastID, err := r.store.State(ctx)
	if err != nil {
		return err
	}
	r.identity.Store(ident)
	latest := ident.Latest()
	var newest *tailEvent
	for i, e := range events {
		if e.origin.Epoch > latest.N {
			why := fmt.Sprintf("stream %s holds event %d of epoch %d of database %s (sequence %d), but the outbox knows epochs up to %d only: "+
				"another copy of this database (a clone or a promoted standby, with the same system identifier and name) publishes into this stream, "+
				"or the database was restored from a backup older than epoch %d. Not publishing. When you know it is a restore, begin the next epoch "+
				"(as fanout_migrate or the relay's role): SELECT fanout_outbox_new_epoch(%d, %d, %d, %d, 'restored from a backup older than epoch %d')",
				r.stream.Name, e.id, e.origin.Epoch, ident.Database, e.seq, latest.N, e.origin.Epoch,
				latest.N, e.origin.Epoch+1, lastID+1, highestID(events), e.origin.Epoch)
			r.conflict.Store(&why)
			return fmt.Errorf("%w: %s", ErrUnknownEpoch, why)
		}
		if e.origin.Epoch == latest.N && (newest == nil || e.id > newest.id) {
			newest = &events[i]
		}
	}
	r.conflict.Store(nil)
	if newest == nil {
		return nil // none of the current epoch: published before it began
	}
	var why string
	if newest.id > lastID {
		why = fmt.Sprintf("the stream holds event %d (sequence %d), but the outbox has handed out ids up to %d only",
			newest.id, newest.seq, lastID)
	} else {
		row, ok, err := r.store.Event(ctx, newest.id)
		if err != nil {
			return err
		}
		switch {
		case !ok:
			created, perr := time.Parse(time.RFC3339Nano, newest.createdAt)
			if perr != nil {
				return nil
			}
			recent, err := r.store.RecentlyCreated(ctx, created, r.cfg.SentRetention)
			if err != nil {
				return err
			}
			if recent {
				// Retention drops a row only relay.sent_retention after
				// its publish, and a rolled-back id was never published.
				why = fmt.Sprintf("the stream holds event %d (sequence %d, created %s), whose outbox row is gone, although no row that young is dropped (relay.sent_retention %s)",
					newest.id, newest.seq, newest.createdAt, r.cfg.SentRetention)
			}
		default:
			if created := row.CreatedAt.Time.UTC().Format(time.RFC3339Nano); created != newest.createdAt ||
				row.EventType != newest.eventType || row.AggregateType+"/"+row.AggregateID != newest.aggregate {
				why = fmt.Sprintf("the stream holds event %d (sequence %d: %s of %s, created %s), but outbox row %d is %s of %s/%s, created %s",
					newest.id, newest.seq, newest.eventType, newest.aggregate, newest.createdAt,
					row.ID, row.EventType, row.AggregateType, row.AggregateID, created)
			}
		}
	}
	if why == "" {
		return nil
	}
	created, err := time.Parse(time.RFC3339Nano, newest.createdAt)
	if err != nil {
		created = time.Now() // every row older than now is taken as the backup's
	}
	firstID, err := r.store.RewoundFrom(ctx, newest.id, created, lastID, latest.FirstID)
	if err != nil {
		return err
	}
	reason := "the outbox's ids were rewound (a restore from a backup?): " + why
	epoch, err := r.store.NewEpoch(ctx, latest.N, latest.N+1, firstID, highestID(events), reason)
	if err != nil {
		return err
	}
	r.obs.Rewound()
	r.logger.Error("the database was restored to an earlier point: its outbox's ids were rewound; "+
		"its new events begin a new epoch, and the stream's events of the lost ids are no longer in the database",
		"database", ident.Database.String(), "detail", why, "epoch", epoch, "epoch_first_id", firstID,
		"lost_ids", fmt.Sprintf("%d..%d", firstID, newest.id))
	ident, err = r.store.ReadIdentity(ctx)
	if err != nil {
		return err
	}
	r.identity.Store(ident)
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

// markOriginStale asks for a rewind check before the next publish.
func (r *Relay) markOriginStale() { r.originWant.Add(1) }

// guardOrigin runs the rewind check when one is due, before a batch is
// published; an error holds the batch back (it is retried).
func (r *Relay) guardOrigin(ctx context.Context) error {
	if r.foreign.Load() {
		return fmt.Errorf("%w: not publishing (see the relay's log)", ErrForeignStream)
	}
	if r.hooks.Anonymous {
		return nil
	}
	// A restore, a failover or a restart of Postgres changes its start
	// time, whether or not a query of this relay's failed meanwhile.
	started, err := r.store.PostgresStarted(ctx)
	if err != nil {
		r.markOriginStale()
		return fmt.Errorf("check the outbox against the stream (a restore?): %w", err)
	}
	if prev := r.pgStarted.Swap(started.UnixNano()); prev != started.UnixNano() {
		r.markOriginStale()
	}
	want := r.originWant.Load()
	if r.originDone.Load() >= want {
		return nil
	}
	if err := r.checkRewind(ctx, want); err != nil {
		return fmt.Errorf("check the outbox against the stream (a restore?): %w", err)
	}
	return nil
}

// originCheck is the periodic part: owner and rewind, with the stream check.
func (r *Relay) originCheck(ctx context.Context) {
	if err := r.checkOwner(ctx); err != nil {
		r.logger.Error("not publishing", "error", err)
	}
	r.markOriginStale()
}

// originErr says why the relay does not publish, if it is the stream's
// owner or an unknown epoch (readiness).
func (r *Relay) originErr() error {
	if r.foreign.Load() {
		return fmt.Errorf("%w: not publishing (see the relay's log)", ErrForeignStream)
	}
	if why := r.conflict.Load(); why != nil {
		return fmt.Errorf("%w: %s", ErrUnknownEpoch, *why)
	}
	return nil
}
