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
// Postgres went away (a restore stops it), and every stream.check_interval.

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
		err = nil
		if r.stream.Databases != stream.SeveralDatabases && info.State.Msgs > 0 {
			m, gerr := s.GetMsg(ctx, info.State.LastSeq)
			if gerr != nil && !errors.Is(gerr, jetstream.ErrMsgNotFound) {
				return fmt.Errorf("read stream %s's newest event: %w", r.stream.Name, gerr)
			}
			if gerr == nil {
				if o, perr := outbox.ParseOrigin(m.Header.Get(outbox.OriginHeader)); perr == nil && o.Database.String() != own {
					err = fmt.Errorf("stream %s records no owner, but its newest event (sequence %d) is database %s's, not this relay's database %s: "+
						"give this database a stream of its own (stream.name, stream.subject_prefix), or share one on purpose (stream.databases several)",
						r.stream.Name, info.State.LastSeq, o.Database, own)
				}
			}
		}
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

// newestOfDatabase is the newest event of this database in the stream, by
// stream sequence, as a restore check needs it.
type newestOfDatabase struct {
	seq       uint64
	origin    outbox.Origin
	id        int64
	createdAt string
	eventType string
	aggregate string
}

// newestScan bounds how many messages a shared stream is read back from
// its end to find this database's newest event.
const newestScan = 1000

// newestEvent reads back from the stream's end to the newest event of
// db: the last message, in a stream that one database owns.
func (r *Relay) newestEvent(ctx context.Context, db outbox.Database) (newestOfDatabase, bool, error) {
	s, err := r.js.Stream(ctx, r.stream.Name)
	if err != nil {
		return newestOfDatabase{}, false, err
	}
	state := s.CachedInfo().State
	prefix := db.String() + "/"
	for seq, n := state.LastSeq, 0; seq >= state.FirstSeq && seq > 0 && n < newestScan; seq, n = seq-1, n+1 {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return newestOfDatabase{}, false, err
		}
		o := m.Header.Get(outbox.OriginHeader)
		if !strings.HasPrefix(o, prefix) {
			continue
		}
		origin, err := outbox.ParseOrigin(o)
		if err != nil {
			continue
		}
		id, err := strconv.ParseInt(m.Header.Get(outbox.EventIDHeader), 10, 64)
		if err != nil {
			continue
		}
		return newestOfDatabase{seq: seq, origin: origin, id: id, createdAt: m.Header.Get(outbox.CreatedAtHeader),
			eventType: m.Header.Get(outbox.EventTypeHeader),
			aggregate: m.Header.Get(outbox.AggregateTypeHeader) + "/" + m.Header.Get(outbox.AggregateIDHeader)}, true, nil
	}
	return newestOfDatabase{}, false, nil
}

// checkRewind compares the outbox with the newest event of this database
// in the stream, and begins a new epoch if a restore rewound the ids.
func (r *Relay) checkRewind(ctx context.Context) error {
	r.rewindMu.Lock()
	defer r.rewindMu.Unlock()
	ident, err := r.store.ReadIdentity(ctx)
	if err != nil {
		return err
	}
	r.identity.Store(ident)
	newest, found, err := r.newestEvent(ctx, ident.Database)
	if err != nil {
		return fmt.Errorf("read the newest event of this database in stream %s: %w", r.stream.Name, err)
	}
	if !found {
		return nil
	}
	latest := ident.Latest()
	if newest.origin.Epoch < latest.N {
		return nil // published before the epoch this database is in now
	}
	lastID, err := r.store.LastID(ctx)
	if err != nil {
		return err
	}
	var why string
	switch {
	case newest.origin.Epoch > latest.N:
		why = fmt.Sprintf("the stream holds event %d of epoch %d (sequence %d), but the outbox knows epochs up to %d only",
			newest.id, newest.origin.Epoch, newest.seq, latest.N)
	case newest.id > lastID:
		why = fmt.Sprintf("the stream holds event %d (sequence %d), but the outbox has handed out ids up to %d only",
			newest.id, newest.seq, lastID)
	default:
		row, ok, err := r.store.Event(ctx, newest.id)
		if err != nil {
			return err
		}
		if !ok {
			return nil // sent and dropped by retention, or a rolled-back id
		}
		if created := row.CreatedAt.Time.UTC().Format(time.RFC3339Nano); created != newest.createdAt ||
			row.EventType != newest.eventType || row.AggregateType+"/"+row.AggregateID != newest.aggregate {
			why = fmt.Sprintf("the stream holds event %d (sequence %d: %s of %s, created %s), but outbox row %d is %s of %s/%s, created %s",
				newest.id, newest.seq, newest.eventType, newest.aggregate, newest.createdAt,
				row.ID, row.EventType, row.AggregateType, row.AggregateID, created)
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
	epoch, err := r.store.NewEpoch(ctx, latest.N, max(latest.N, newest.origin.Epoch)+1, firstID, newest.id, reason)
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

// guardOrigin runs the rewind check when one is due, before a batch is
// published; false if it could not run (the batch is retried).
func (r *Relay) guardOrigin(ctx context.Context) error {
	if r.foreign.Load() {
		return fmt.Errorf("%w: not publishing (see the relay's log)", ErrForeignStream)
	}
	if !r.originStale.Load() || r.hooks.Anonymous {
		return nil
	}
	if err := r.checkRewind(ctx); err != nil {
		return fmt.Errorf("check the outbox against the stream (a restore?): %w", err)
	}
	r.originStale.Store(false)
	return nil
}

// originCheck is the periodic part: owner and rewind, with the stream check.
func (r *Relay) originCheck(ctx context.Context) {
	if err := r.checkOwner(ctx); err != nil {
		r.logger.Error("not publishing", "error", err)
	}
	r.originStale.Store(true)
}
