package operator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// The stream metadata that names its owner (package stream; its name is
// shadowed below by a variable).
const (
	streamOwnerKey = stream.OwnerKey
	streamShared   = stream.SeveralDatabases
)

// Status is what `fanout status` reports.
type Status struct {
	// Database is this database's identity, which every event it writes
	// carries (Fanout-Origin), and its outbox's epochs: a restore that
	// rewound the ids began a new one.
	Database struct {
		Name   string         `json:"name"` // <system identifier>/<database>
		Epoch  int            `json:"epoch"`
		Epochs []outbox.Epoch `json:"epochs"`
	} `json:"database"`
	Outbox struct {
		Pending          int64   `json:"pending"`
		Sending          int64   `json:"sending"`
		Sent             int64   `json:"sent"`
		Failed           int64   `json:"failed"`
		OldestPendingAge float64 `json:"oldest_pending_age_seconds"`
		// Ranges are the outbox's partitions, SealedRanges those full and
		// waiting for their retention; DefaultRows are the rows no range
		// holds (outbox_default).
		Ranges       int   `json:"ranges"`
		SealedRanges int   `json:"sealed_ranges"`
		DefaultRows  int64 `json:"default_rows"`
		// HeldRows are events held behind a failed earlier event of their
		// aggregate (relay.on_failed hold), in HeldAggregates aggregates.
		HeldRows       int64 `json:"held_rows"`
		HeldAggregates int64 `json:"held_aggregates"`
		// Unnumbered are the event types the outbox does not number in
		// their aggregate (fanout outbox numbering).
		Unnumbered []string `json:"unnumbered_event_types"`
	} `json:"outbox"`
	// Audits are the newest audit of the stream against the outbox, and
	// the newest that found events missing, if another (newest first).
	Audits []outboxstore.Audit `json:"audits"`
	Stream struct {
		Name     string `json:"name"`
		Messages uint64 `json:"messages"`
		Bytes    uint64 `json:"bytes"`
		FirstSeq uint64 `json:"first_seq"`
		LastSeq  uint64 `json:"last_seq"`
		// Missing: the stream does not exist yet (the relay creates it).
		Missing bool `json:"missing,omitempty"`
		// Owner is the database the stream records as its owner (metadata
		// fanout.database), "several" for a shared one, "" if it records
		// none; Foreign says it is not this database.
		Owner   string `json:"owner"`
		Foreign bool   `json:"foreign,omitempty"`
	} `json:"stream"`
	// Capture is how the relays find committed rows, and in wal capture
	// their replication slot.
	Capture     CaptureStatus      `json:"capture"`
	Subscribers []SubscriberStatus `json:"subscribers"`
	// Backfills are the subscribers' backfills (fanout backfill), running,
	// paused or finished.
	Backfills []Backfill `json:"backfills,omitempty"`
	// Replays are the last day's replay requests (fanout replay), newest
	// first, and what came of each.
	Replays []bookkeeping.ReplayRecord `json:"replays,omitempty"`
	// Stages are the last minute's stage latencies, when Sources.Ops names
	// endpoints to read them from.
	Stages *Stages `json:"stages,omitempty"`
}

// CaptureStatus is the relays' capture mode and, in wal capture, the slot.
type CaptureStatus struct {
	Mode string `json:"mode"`
	// Slot is the replication slot's state (wal capture; nil until the
	// relay created it).
	Slot *relay.SlotState `json:"slot,omitempty"`
	// BacklogDone: the rows committed before the slot existed are all
	// published (wal capture).
	BacklogDone bool `json:"backlog_done,omitempty"`
}

// Backfill is one subscriber's backfill.
type Backfill struct {
	Subscriber   string     `json:"subscriber"`
	Where        string     `json:"where,omitempty"`
	Total        int64      `json:"total_rows"`
	Done         int64      `json:"done_rows"`
	Failed       int64      `json:"failed_rows"`
	Segments     int        `json:"segments"`
	SegmentsDone int        `json:"segments_done"`
	Paused       bool       `json:"paused,omitempty"`
	StartedAt    time.Time  `json:"started_at"`
	UpdatedAt    time.Time  `json:"updated_at"`
	FinishedAt   *time.Time `json:"finished_at,omitempty"`
}

// SubscriberStatus is one subscriber's state.
type SubscriberStatus struct {
	Name         string `json:"name"`
	Pending      uint64 `json:"pending"`
	AckPending   int    `json:"ack_pending"`
	Redelivered  int    `json:"redelivered"`
	Checkpoint   int64  `json:"checkpoint_rows"`
	DeadLetters  uint64 `json:"dead_letters"`
	ConsumerGone bool   `json:"consumer_missing,omitempty"`
	// HeldAggregates: an ordered subscriber's aggregates held behind a
	// dead-lettered event (subscribers.on_dead_letter hold).
	HeldAggregates int64 `json:"held_aggregates"`
}

// Sources are what a status is read from.
type Sources struct {
	Pool        *pgxpool.Pool
	JS          jetstream.JetStream
	Relay       relay.Config
	Stream      stream.Config
	Subscribers subscribers.Config
	// Known are the subscribers the binary runs: each is reported, with or
	// without a consumer.
	Known []string
	// Ops are the roles' operations endpoints (host:port) to read the stage
	// latencies from; none, no stages.
	Ops []string
}

// ReadStatus reads the outbox, the events stream, every subscriber's
// consumer, checkpoint and dead letters to resolve. Subscribers are those
// known, and any other the stream, the checkpoints or the dead letters
// name. A stream not created yet is a state to report, not an error.
func ReadStatus(ctx context.Context, src Sources) (Status, error) {
	var st Status
	if err := readOutbox(ctx, src, &st); err != nil {
		return st, err
	}
	if err := readCapture(ctx, src, &st); err != nil {
		return st, err
	}
	stream, err := readStream(ctx, src, &st)
	if err != nil {
		return st, err
	}
	if err := readSubscribers(ctx, src, stream, &st); err != nil {
		return st, err
	}
	backfills, err := backfill.List(ctx, src.Pool)
	if err != nil {
		return st, err
	}
	for _, b := range backfills {
		st.Backfills = append(st.Backfills, Backfill{Subscriber: b.Subscriber, Where: b.Where, Total: b.Total, Done: b.Done,
			Failed: b.Failed, Segments: b.Segments, SegmentsDone: b.SegmentsDone, Paused: b.Paused, StartedAt: b.StartedAt, UpdatedAt: b.UpdatedAt, FinishedAt: b.FinishedAt})
	}
	if st.Replays, err = bookkeeping.NewReplays(src.Pool).Recent(ctx, time.Now().Add(-24*time.Hour), 20); err != nil {
		return st, fmt.Errorf("replays: %w", err)
	}
	if len(src.Ops) > 0 {
		stages := ReadStages(ctx, src.Ops)
		st.Stages = &stages
	}
	return st, nil
}

// readOutbox reads the database's identity, the outbox's rows and ranges,
// and the newest audits into st.
func readOutbox(ctx context.Context, src Sources, st *Status) error {
	store := outboxstore.New(src.Pool)
	store.OnFailed = outboxstore.OnFailed(src.Relay.OnFailed)
	ident, err := store.ReadIdentity(ctx)
	if err != nil {
		return err
	}
	st.Database.Name, st.Database.Epoch, st.Database.Epochs = ident.Database.String(), ident.Latest().N, ident.Epochs
	backlog, err := store.Backlog(ctx)
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	sent, err := store.CountSent(ctx)
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	st.Outbox.Pending, st.Outbox.Sending, st.Outbox.Sent, st.Outbox.Failed = backlog.Pending, backlog.Sending, sent, backlog.Failed
	st.Outbox.OldestPendingAge = backlog.OldestPending.Seconds()
	if backlog.Failed > 0 {
		if st.Outbox.HeldRows, st.Outbox.HeldAggregates, err = store.Held(ctx); err != nil {
			return fmt.Errorf("outbox: events held behind failed ones: %w", err)
		}
	}
	if st.Outbox.Unnumbered, err = store.Unnumbered(ctx); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	if st.Outbox.Ranges, st.Outbox.SealedRanges, st.Outbox.DefaultRows, err = store.RangeCounts(ctx); err != nil {
		return fmt.Errorf("outbox ranges: %w", err)
	}
	st.Audits, err = store.Audits(ctx)
	return err
}

// readCapture reads the relays' capture mode into st, and in wal capture
// their slot and whether the rows from before it are published.
func readCapture(ctx context.Context, src Sources, st *Status) error {
	st.Capture.Mode = src.Relay.Capture
	if st.Capture.Mode == "" {
		st.Capture.Mode = relay.CapturePoll
	}
	if st.Capture.Mode != relay.CaptureWAL {
		return nil
	}
	slot, _, ok, err := relay.ReadSlot(ctx, src.Pool, src.Relay.Slot)
	if err != nil {
		return err
	}
	if ok {
		st.Capture.Slot = &slot
	}
	err = src.Pool.QueryRow(ctx, `SELECT backlog_done_at IS NOT NULL FROM relay_capture WHERE slot_name = $1`, src.Relay.Slot).Scan(&st.Capture.BacklogDone)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("relay_capture: %w", err)
	}
	return nil
}

// readStream reads the events stream's state and owner into st, and
// returns the stream: nil if it does not exist yet.
func readStream(ctx context.Context, src Sources, st *Status) (jetstream.Stream, error) {
	st.Stream.Name = src.Stream.Name
	stream, err := src.JS.Stream(ctx, src.Stream.Name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		st.Stream.Missing = true
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("stream %s: %w", src.Stream.Name, err)
	}
	info := stream.CachedInfo()
	st.Stream.Messages, st.Stream.Bytes = info.State.Msgs, info.State.Bytes
	st.Stream.FirstSeq, st.Stream.LastSeq = info.State.FirstSeq, info.State.LastSeq
	st.Stream.Owner = info.Config.Metadata[streamOwnerKey]
	st.Stream.Foreign = st.Stream.Owner != "" && st.Stream.Owner != streamShared && st.Stream.Owner != st.Database.Name
	return stream, nil
}

// readSubscribers reads into st a status for every subscriber known, or
// named by a checkpoint, a dead letter or a consumer of stream (nil: none).
func readSubscribers(ctx context.Context, src Sources, stream jetstream.Stream, st *Status) error {
	checkpoints, err := subscribers.CountCheckpoints(ctx, src.Pool)
	if err != nil {
		return err
	}
	held, err := subscribers.CountHeldAggregates(ctx, src.Pool)
	if err != nil {
		return err
	}
	dead, err := Counts(ctx, src.Pool, src.JS, src.Subscribers)
	if err != nil {
		return err
	}
	names := map[string]bool{}
	for _, n := range src.Known {
		names[n] = true
	}
	for n := range checkpoints {
		names[n] = true
	}
	for n := range dead {
		names[n] = true
	}
	consumers := map[string]*jetstream.ConsumerInfo{}
	if stream != nil {
		lister := stream.ListConsumers(ctx)
		for ci := range lister.Info() {
			consumers[ci.Name] = ci
			names[ci.Name] = true
		}
		if err := lister.Err(); err != nil {
			return err
		}
	}
	for n := range names {
		s := SubscriberStatus{Name: n, Checkpoint: checkpoints[n], DeadLetters: dead[n], HeldAggregates: held[n]}
		if ci, ok := consumers[n]; ok {
			s.Pending, s.AckPending, s.Redelivered = ci.NumPending, ci.NumAckPending, ci.NumRedelivered
		} else {
			s.ConsumerGone = true
		}
		st.Subscribers = append(st.Subscribers, s)
	}
	slices.SortFunc(st.Subscribers, func(x, y SubscriberStatus) int { return strings.Compare(x.Name, y.Name) })
	return nil
}

// subscriberOf reads the subscriber from a dead letter's subject
// (<prefix>.<subscriber>.<event_type>).
func subscriberOf(subject string) (string, bool) {
	parts := strings.SplitN(subject, ".", 3)
	if len(parts) < 3 || parts[1] == "" {
		return "", false
	}
	return parts[1], true
}
