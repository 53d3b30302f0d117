package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgtype"
)

// Publication is the publication a wal relay's slot decodes: inserts into
// the outbox and updates of its rows (schema/migrations/00006 and 00007).
const Publication = "fanout_outbox"

// walStatusInterval is how often a streaming relay confirms its position to
// the server: the longest a confirmed event waits to be confirmed, so also
// the span a relay killed at any moment publishes again (as duplicates that
// JetStream drops).
const walStatusInterval = time.Second

// standbyRetry is how often a relay whose slot another relay streams from
// tries to take it over.
const standbyRetry = time.Second

// Capture states, for readiness and status.
const (
	captureConnecting int32 = iota
	captureStandby
	captureStreaming
)

// errSlotInUse: another relay streams from the slot; this one stands by.
var errSlotInUse = errors.New("replication slot in use by another relay")

// errNotVisibleYet: a decoded row is not visible to other sessions yet.
var errNotVisibleYet = errors.New("decoded row not visible yet")

// visibleWithin bounds the wait for a decoded row to become visible.
const visibleWithin = 5 * time.Second

// errSlotLost: the server invalidated the slot (max_slot_wal_keep_size);
// the WAL it needed is gone.
var errSlotLost = errors.New("replication slot invalidated")

// walLoop keeps one replication stream from the slot open while the relay
// runs: it reconnects after any failure and stands by while another relay
// holds the slot (Postgres lets one connection stream from a slot at a time,
// and a relay that dies releases it as its connection closes).
func (r *Relay) walLoop(softCtx, hardCtx context.Context) {
	wait := 100 * time.Millisecond
	for softCtx.Err() == nil {
		err := r.streamSlot(softCtx, hardCtx, 0)
		if softCtx.Err() != nil {
			return
		}
		r.touchCapture()
		msg := err.Error()
		r.lastClaimErr.Store(&msg)
		switch {
		case errors.Is(err, errSlotInUse):
			if r.captureState.Swap(captureStandby) != captureStandby {
				r.logger.Info("standing by: another relay streams from the slot", "slot", r.cfg.Slot, "detail", err)
			}
			wait = 100 * time.Millisecond
			if !r.sleep(softCtx, standbyRetry) {
				return
			}
			continue
		case errors.Is(err, errSlotLost):
			r.captureState.Store(captureConnecting)
			r.logger.Error("replication slot invalidated", "slot", r.cfg.Slot, "error", err)
		default:
			r.captureState.Store(captureConnecting)
			r.logger.Error("stream from the replication slot", "slot", r.cfg.Slot, "error", err, "retry_in", wait)
		}
		if !r.sleep(softCtx, wait) {
			return
		}
		wait = min(wait*2, 5*time.Second)
	}
}

// touchCapture records contact with the server, for readiness.
func (r *Relay) touchCapture() { r.lastClaimed.Store(time.Now().UnixNano()) }

// errReachedUntil ends a stream that confirmed the position it was asked
// to reach.
var errReachedUntil = errors.New("the slot is confirmed past the position asked for")

// streamSlot streams from the slot until ctx ends or the stream fails, or,
// with until set, until the slot is confirmed at least that far (the slot
// must exist then, and rows from before it are not claimed).
func (r *Relay) streamSlot(softCtx, hardCtx context.Context, until pglogrepl.LSN) error {
	cc := r.pool.Config().ConnConfig.Config.Copy()
	if cc.RuntimeParams == nil {
		cc.RuntimeParams = map[string]string{}
	}
	cc.RuntimeParams["replication"] = "database"
	connectCtx, cancel := context.WithTimeout(softCtx, 10*time.Second)
	conn, err := pgconn.ConnectConfig(connectCtx, cc)
	cancel()
	if err != nil {
		return fmt.Errorf("replication connection: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()

	backlogThrough, backlogDone, err := r.ensureSlot(softCtx, conn, until == 0)
	if err != nil {
		return err
	}
	if until != 0 {
		backlogDone = true // claimed by the poll relay that asked
	}
	// Rows committed before the slot existed are not in its stream: they
	// are published by claiming them, as the poll relay does, and all of
	// them before the stream starts: an aggregate's older event claimed
	// from the backlog would otherwise enter the stream after its newer
	// one decoded from the slot (the fault run caught one). The slot
	// keeps the WAL meanwhile.
	if !backlogDone {
		r.drainBacklog(softCtx, hardCtx, backlogThrough)
		if softCtx.Err() != nil {
			return softCtx.Err()
		}
		backlogDone = true
	}
	startCtx, cancel := context.WithTimeout(softCtx, 10*time.Second)
	err = pglogrepl.StartReplication(startCtx, conn, r.cfg.Slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + Publication + "'"},
	})
	cancel()
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use: "replication slot ... is active for PID ..."
			return fmt.Errorf("%w: %s", errSlotInUse, pgErr.Message)
		}
		return fmt.Errorf("start replication from slot %s: %w", r.cfg.Slot, err)
	}
	if r.captureState.Swap(captureStreaming) != captureStreaming {
		r.logger.Info("streaming from the replication slot", "slot", r.cfg.Slot, "publication", Publication)
	}
	r.touchCapture()

	var drain sync.WaitGroup // the watcher below
	defer drain.Wait()
	// The failed events that hold their aggregates (relay.on_failed hold),
	// as the table has them now: the stream starts from the confirmed
	// position, and marked them failed before it.
	if r.store.OnFailed != outbox.SkipFailed {
		loadCtx, cancel := context.WithTimeout(softCtx, 10*time.Second)
		err := r.order.loadHolds(loadCtx, r)
		cancel()
		if err != nil {
			return fmt.Errorf("read the failed events that hold their aggregates: %w", err)
		}
	}

	// A server shutting down waits for its walsenders' clients to confirm
	// everything sent (even a fast shutdown): a relay that cannot publish
	// (NATS down) would hold the server up. So the stream ends when the
	// server says it is stopping; what it had not confirmed is decoded
	// again after the restart.
	streamCtx, endStream := context.WithCancelCause(softCtx)
	defer endStream(nil)
	s := &walStream{r: r, conn: conn, relations: map[uint32]*relationColumns{}, types: pgtype.NewMap(), queue: make(chan *walTxn, r.cfg.MaxInFlight+64), until: until}
	s.progressAt.Store(time.Now().UnixNano())
	drain.Add(1)
	go func() {
		defer drain.Done()
		s.watchServerStopping(streamCtx, endStream)
	}()
	err = s.run(streamCtx, hardCtx)
	if cause := context.Cause(streamCtx); err == nil && softCtx.Err() == nil && cause != nil {
		err = cause
	}
	return err
}

// errServerStopping ends a stream whose server is shutting down.
var errServerStopping = errors.New("the server is shutting down: the replication stream is closed so that it can stop (unconfirmed events are decoded again after its restart)")

// stuckAfter is how long confirmation may wait with work in flight before
// the stream checks whether the server is stopping.
const stuckAfter = 2 * time.Second

// watchServerStopping ends the stream (end) if, while its confirmation is
// stuck, a plain connection finds the server shutting down.
func (s *walStream) watchServerStopping(ctx context.Context, end context.CancelCauseFunc) {
	t := time.NewTicker(walStatusInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.queued.Load() == 0 || time.Since(time.Unix(0, s.progressAt.Load())) < stuckAfter {
			continue
		}
		pingCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := s.r.pool.Exec(pingCtx, "SELECT 1")
		cancel()
		if serverStopping(err) {
			s.r.logger.Warn("Postgres is shutting down: closing the replication stream so that it can stop", "slot", s.r.cfg.Slot, "error", err)
			end(errServerStopping)
			return
		}
	}
}

// serverStopping reports whether err says the server is shutting down or
// refuses connections while doing so.
func serverStopping(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57P01", "57P02", "57P03": // admin_shutdown, crash_shutdown, cannot_connect_now
			return true
		}
	}
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr)
}

// ensureSlot creates the slot if it does not exist and returns the bound of
// the rows it does not capture (those committed before it), and whether
// they have all been published.
func (r *Relay) ensureSlot(ctx context.Context, conn *pgconn.PgConn, create bool) (backlogThrough int64, backlogDone bool, err error) {
	var (
		plugin, walStatus string
		database          string
		found             bool
	)
	err = r.pool.QueryRow(ctx, `
SELECT plugin, coalesce(database, ''), coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1`, r.cfg.Slot).
		Scan(&plugin, &database, &walStatus)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return 0, false, fmt.Errorf("look up replication slot %s: %w", r.cfg.Slot, err)
	default:
		found = true
	}
	if found {
		var current string
		if err := r.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&current); err != nil {
			return 0, false, err
		}
		if plugin != "pgoutput" || database != current {
			return 0, false, fmt.Errorf("replication slot %s exists but is not fanout's (plugin %q, database %q; want pgoutput on %q): set relay.slot to another name", r.cfg.Slot, plugin, database, current)
		}
		if walStatus == "lost" {
			if !create {
				return 0, false, fmt.Errorf("%w: slot %s has wal_status lost", errSlotLost, r.cfg.Slot)
			}
			if err := r.recoverLostSlot(ctx); err != nil {
				return 0, false, err
			}
			found = false
		}
	}
	if !found && !create {
		return 0, false, fmt.Errorf("replication slot %s is gone", r.cfg.Slot)
	}
	if !found {
		createCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		res, err := pglogrepl.CreateReplicationSlot(createCtx, conn, r.cfg.Slot, "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{SnapshotAction: "NOEXPORT_SNAPSHOT", Mode: pglogrepl.LogicalReplication})
		cancel()
		if err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42710" { // another relay created it a moment ago
				return 0, false, fmt.Errorf("%w: %s", errSlotInUse, pgErr.Message)
			}
			return 0, false, fmt.Errorf("create replication slot %s: %w", r.cfg.Slot, err)
		}
		r.logger.Info("created the replication slot", "slot", res.SlotName, "consistent_point", res.ConsistentPoint)
		// Every row committed before the slot's consistent point has an id
		// at most the highest id visible now; a row with a higher id was
		// inserted later, so the slot decodes it.
		if _, err := r.pool.Exec(ctx, `
INSERT INTO relay_capture (slot_name, backlog_through)
VALUES ($1, (SELECT coalesce(max(id), 0) FROM outbox))
ON CONFLICT (slot_name) DO UPDATE SET backlog_through = EXCLUDED.backlog_through, created_at = now(), backlog_done_at = NULL`,
			r.cfg.Slot); err != nil {
			return 0, false, fmt.Errorf("record the slot's backlog: %w", err)
		}
	}
	// A relay that died between creating the slot and recording its
	// backlog left no row: the bound taken now is higher, which only
	// claims more rows (JetStream drops those the slot also published).
	var doneAt pgtype.Timestamptz
	err = r.pool.QueryRow(ctx, `
INSERT INTO relay_capture (slot_name, backlog_through)
VALUES ($1, (SELECT coalesce(max(id), 0) FROM outbox))
ON CONFLICT (slot_name) DO UPDATE SET slot_name = EXCLUDED.slot_name
RETURNING backlog_through, backlog_done_at`, r.cfg.Slot).Scan(&backlogThrough, &doneAt)
	if err != nil {
		return 0, false, fmt.Errorf("read the slot's backlog: %w", err)
	}
	r.backlogThrough.Store(backlogThrough)
	r.backlogDone.Store(doneAt.Valid)
	return backlogThrough, doneAt.Valid, nil
}

// recoverLostSlot drops a slot the server invalidated (it removed WAL the
// slot still needed, past max_slot_wal_keep_size), so that ensureSlot
// creates it again. The new slot's backlog bound then covers every row the
// outbox still holds, and the drain claims and publishes them all again:
// the events the old slot never delivered among them. JetStream drops
// those inside its duplicates window, the subscribers' checkpoints the
// rest. Events whose rows retention already deleted cannot be recovered;
// the log names the range that is.
func (r *Relay) recoverLostSlot(ctx context.Context) error {
	var lo, hi int64
	var oldest pgtype.Timestamptz
	err := r.pool.QueryRow(ctx, `
SELECT coalesce(min(id), 0), coalesce(max(id), 0), min(created_at)
FROM outbox WHERE published_at IS NULL AND status = 'pending'`).Scan(&lo, &hi, &oldest)
	if err != nil {
		return fmt.Errorf("read the outbox to recover invalidated slot %s: %w", r.cfg.Slot, err)
	}
	if _, err := r.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, r.cfg.Slot); err != nil {
		return fmt.Errorf("drop invalidated replication slot %s: %w", r.cfg.Slot, err)
	}
	r.logger.Error("the server invalidated the replication slot (max_slot_wal_keep_size): it is dropped and created again, "+
		"and every pending row the outbox still holds is published again; events whose rows retention deleted before they were published are lost",
		"slot", r.cfg.Slot, "republish_from_id", lo, "republish_to_id", hi, "oldest_row_created_at", oldest.Time)
	return nil
}

// drainBacklog claims and publishes the rows committed before the slot
// existed (ids up to through), then records that they are done. A relay
// that stops first leaves the record open; the next one drains again.
func (r *Relay) drainBacklog(ctx, hardCtx context.Context, through int64) {
	batch := int64(r.cfg.BatchSize)
	wait := r.cfg.PollInterval
	for ctx.Err() == nil {
		left, err := r.store.UnsentThrough(ctx, through)
		if err == nil && left == 0 && r.store.OnFailed != outbox.SkipFailed {
			_, err = r.store.MarkHeldThrough(ctx, through)
		}
		if err == nil && left == 0 {
			_, err = r.pool.Exec(ctx, `UPDATE relay_capture SET backlog_done_at = now() WHERE slot_name = $1 AND backlog_through = $2`, r.cfg.Slot, through)
			if err == nil {
				r.backlogDone.Store(true)
				r.logger.Info("published the rows committed before the slot existed", "through_id", through)
				return
			}
		}
		if err != nil {
			r.logger.Warn("drain the rows committed before the slot", "error", err)
		}
		if err := r.slots.Acquire(ctx, batch); err != nil {
			return
		}
		token := newLeaseToken()
		rows, err := r.store.ClaimThrough(hardCtx, r.cfg.BatchSize, token, through)
		r.slots.Release(batch - int64(len(rows)))
		if err != nil || len(rows) == 0 {
			if err != nil {
				r.logger.Warn("claim rows committed before the slot", "error", err)
			}
			// Rows backing off, or `sending` under a dead poll relay's
			// lease (the reaper returns them).
			if !r.sleep(ctx, wait) {
				return
			}
			continue
		}
		sortRows(rows)
		r.batches.Add(1)
		func() {
			defer r.batches.Done()
			defer r.slots.Release(int64(len(rows)))
			// The rows after the bound are the slot's to publish: no
			// next event of an aggregate is claimed here.
			held := int64(len(rows))
			r.deliver(hardCtx, rows, token, false, &held)
		}()
	}
}

// relationColumns maps the outbox's columns to their places in a tuple.
type relationColumns struct {
	outbox bool
	index  map[string]int
}

// walTxn is one decoded transaction: its rows are published in chunks, and
// the slot may be confirmed past it once every chunk is done.
type walTxn struct {
	xid       uint32        // its transaction id, for the visibility gate
	end       pglogrepl.LSN // the end of its commit record, set at commit
	commitAt  time.Time
	chunks    sync.WaitGroup // the commit, and each chunk in flight
	abandoned atomic.Bool    // a chunk stopped before all its rows were published
}

// walStream is one open replication stream.
type walStream struct {
	r         *Relay
	conn      *pgconn.PgConn
	relations map[uint32]*relationColumns
	types     *pgtype.Map // not safe for concurrent use: one per stream
	cur       *walTxn
	rows      []row         // the current transaction's rows not yet dispatched
	refetch   []int         // indexes in rows of versions decoded without a value (unchanged TOAST), ascending
	rowAt     map[int64]int // id -> index in rows

	until      pglogrepl.LSN // end the stream once confirmed this far (0: never)
	queue      chan *walTxn  // transactions in commit order, to confirm
	queued     atomic.Int64  // transactions in queue or being waited on
	confirmed  atomic.Uint64 // the position safe to confirm
	progressAt atomic.Int64  // unix nanoseconds when a transaction was last confirmed, or the queue last empty
	stopped    atomic.Bool   // the confirmer met an abandoned transaction
}

func (s *walStream) run(softCtx, hardCtx context.Context) (err error) {
	r := s.r
	confirmerDone := make(chan struct{})
	go func() {
		defer close(confirmerDone)
		s.confirm(hardCtx)
	}()
	defer func() {
		// Let the chunks in flight finish (their PubAcks arrive, or the
		// hard stop abandons them), then confirm what they published.
		if s.cur != nil {
			s.cur.abandoned.Store(true)
			s.cur.chunks.Done()
			s.cur = nil
		}
		close(s.queue)
		<-confirmerDone
		if sendErr := s.sendStatus(context.Background()); sendErr != nil && err == nil && softCtx.Err() == nil {
			err = sendErr
		}
	}()

	nextStatus := time.Now().Add(walStatusInterval)
	for {
		reached := s.until != 0 && pglogrepl.LSN(s.confirmed.Load()) >= s.until
		if reached || time.Now().After(nextStatus) {
			if err := s.sendStatus(softCtx); err != nil {
				return err
			}
			if reached {
				return errReachedUntil
			}
			nextStatus = time.Now().Add(walStatusInterval)
			if s.until != 0 {
				nextStatus = time.Now().Add(100 * time.Millisecond)
			}
		}
		ctx, cancel := context.WithDeadline(softCtx, nextStatus)
		raw, err := s.conn.ReceiveMessage(ctx)
		cancel()
		if err != nil {
			if softCtx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("receive from the replication slot: %w", err)
		}
		r.touchCapture()
		switch msg := raw.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("replication stream: %w", pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyData:
			if len(msg.Data) == 0 {
				continue
			}
			switch msg.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
				if err != nil {
					return fmt.Errorf("parse keepalive: %w", err)
				}
				s.idleConfirm(ka.ServerWALEnd)
				if ka.ReplyRequested {
					nextStatus = time.Time{}
				}
			case pglogrepl.XLogDataByteID:
				xld, err := pglogrepl.ParseXLogData(msg.Data[1:])
				if err != nil {
					return fmt.Errorf("parse WAL data: %w", err)
				}
				if err := s.decode(softCtx, hardCtx, xld.WALData); err != nil {
					return err
				}
			}
		}
	}
}

// idleConfirm lets the slot advance over WAL that holds no outbox rows
// (other tables' writes, checkpoints) when nothing is in flight: end is the
// position up to which the server has sent everything.
func (s *walStream) idleConfirm(end pglogrepl.LSN) {
	if s.cur != nil || s.queued.Load() > 0 || s.stopped.Load() {
		return
	}
	for {
		c := s.confirmed.Load()
		if uint64(end) <= c || s.confirmed.CompareAndSwap(c, uint64(end)) {
			return
		}
	}
}

func (s *walStream) sendStatus(ctx context.Context) error {
	pos := pglogrepl.LSN(s.confirmed.Load())
	if pos == 0 {
		return nil
	}
	if s.conn.IsClosed() {
		// A failed receive closes the connection in the background; a
		// write now would race that close. The next stream confirms.
		return errors.New("replication connection closed")
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pos}); err != nil {
		return fmt.Errorf("confirm slot position %s: %w", pos, err)
	}
	s.r.confirmedLSN.Store(uint64(pos))
	return nil
}

// confirm advances the confirmable position over transactions in commit
// order as each is completely published; it stops at the first abandoned
// one, which the next stream decodes again.
func (s *walStream) confirm(hardCtx context.Context) {
	for txn := range s.queue {
		txn.chunks.Wait()
		if txn.abandoned.Load() {
			s.stopped.Store(true)
		}
		if s.stopped.Load() {
			s.queued.Add(-1)
			continue
		}
		if h := s.r.testHookBeforeConfirm; h != nil {
			h(hardCtx, txn.end)
		}
		if hardCtx.Err() != nil {
			// Cut short: what is not confirmed yet is decoded again by
			// the next stream (the test hook stands for a kill here).
			s.stopped.Store(true)
			s.queued.Add(-1)
			continue
		}
		for {
			c := s.confirmed.Load()
			if uint64(txn.end) <= c || s.confirmed.CompareAndSwap(c, uint64(txn.end)) {
				break
			}
		}
		s.r.confirmedAt.Store(time.Now().UnixNano())
		s.progressAt.Store(time.Now().UnixNano())
		s.queued.Add(-1)
	}
}

// decode handles one pgoutput message.
func (s *walStream) decode(softCtx, hardCtx context.Context, data []byte) error {
	msg, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("decode pgoutput message: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessage:
		rel := &relationColumns{outbox: m.RelationName == "outbox", index: map[string]int{}}
		for i, c := range m.Columns {
			rel.index[c.Name] = i
		}
		if rel.outbox {
			for _, name := range []string{"id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "created_at", "status", "published_at"} {
				if _, ok := rel.index[name]; !ok {
					return fmt.Errorf("the outbox table %s.%s as decoded has no column %s: is the schema migrated?", m.Namespace, m.RelationName, name)
				}
			}
		}
		s.relations[m.RelationID] = rel
	case *pglogrepl.BeginMessage:
		if s.queued.Load() == 0 {
			s.progressAt.Store(time.Now().UnixNano())
		}
		s.cur = &walTxn{xid: m.Xid}
		s.cur.chunks.Add(1) // done at commit
		s.queued.Add(1)
		if err := s.enqueue(softCtx, s.cur); err != nil {
			return err
		}
	case *pglogrepl.InsertMessage:
		return s.capture(softCtx, hardCtx, m.RelationID, m.Tuple)
	case *pglogrepl.UpdateMessage:
		return s.capture(softCtx, hardCtx, m.RelationID, m.NewTuple)
	case *pglogrepl.CommitMessage:
		if s.cur == nil {
			return nil
		}
		s.cur.end = m.TransactionEndLSN
		s.cur.commitAt = m.CommitTime
		if err := s.dispatch(softCtx, hardCtx); err != nil {
			return err
		}
		s.cur.chunks.Done()
		s.cur = nil
	}
	return nil
}

// capture collects a decoded outbox row version for publishing when it is
// one the poll relay would claim: pending and unpublished. An insert is
// that unless its writer chose otherwise; an update is that only when an
// operator returned the row to the relays (a claim, a mark or a failure is
// not), and it is published again as the poll relay would.
func (s *walStream) capture(softCtx, hardCtx context.Context, relationID uint32, tuple *pglogrepl.TupleData) error {
	rel, ok := s.relations[relationID]
	if !ok {
		return fmt.Errorf("change in relation %d before its description", relationID)
	}
	if !rel.outbox || s.cur == nil {
		return nil
	}
	rw, state, err := tupleRow(s.types, rel, tuple)
	if err != nil {
		return err
	}
	// A transaction that inserts a row and then updates it (by hand)
	// decodes two versions with one id: JetStream would keep the first,
	// so the later replaces it (within the chunk not yet dispatched).
	if state == tupleSkipped {
		s.r.order.release(rw)
		state = tupleNotPending
	}
	if state == tupleNotPending {
		if i, ok := s.rowAt[rw.ID]; ok {
			s.dropRow(i)
		}
		return nil
	}
	if i, ok := s.rowAt[rw.ID]; ok {
		s.rows[i] = rw
		s.refetch = slices.DeleteFunc(s.refetch, func(at int) bool { return at == i })
		if state == tupleToasted {
			s.refetch = append(s.refetch, i)
			slices.Sort(s.refetch)
		}
		return nil
	}
	if state == tupleToasted {
		s.refetch = append(s.refetch, len(s.rows))
	}
	if s.rowAt == nil {
		s.rowAt = map[int64]int{}
	}
	s.rowAt[rw.ID] = len(s.rows)
	s.rows = append(s.rows, rw)
	if len(s.rows) >= s.r.cfg.BatchSize {
		return s.dispatch(softCtx, hardCtx)
	}
	return nil
}

// dropRow removes the collected row at index i.
func (s *walStream) dropRow(i int) {
	s.rows = slices.Delete(s.rows, i, i+1)
	clear(s.rowAt)
	for k, rw := range s.rows {
		s.rowAt[rw.ID] = k
	}
	refetch := s.refetch[:0]
	for _, at := range s.refetch {
		switch {
		case at < i:
			refetch = append(refetch, at)
		case at > i:
			refetch = append(refetch, at-1)
		}
	}
	s.refetch = refetch
}

// enqueue hands a transaction to the confirmer without blocking the stream
// past a status interval (the server drops a silent replica).
func (s *walStream) enqueue(ctx context.Context, txn *walTxn) error {
	select {
	case s.queue <- txn:
		return nil
	case <-ctx.Done():
		txn.abandoned.Store(true)
		return ctx.Err()
	}
}

// dispatch publishes the current transaction's rows collected so far as
// one chunk, waiting for room in flight (relay.max_in_flight) first.
func (s *walStream) dispatch(softCtx, hardCtx context.Context) error {
	if len(s.rows) == 0 {
		return nil
	}
	rows, refetch := s.rows, s.refetch
	s.rows, s.refetch = nil, nil
	clear(s.rowAt)
	n := int64(len(rows))
	for {
		ctx, cancel := context.WithTimeout(softCtx, walStatusInterval)
		err := s.r.slots.Acquire(ctx, n)
		cancel()
		if err == nil {
			break
		}
		if softCtx.Err() != nil {
			return softCtx.Err()
		}
		// Stay in touch with the server while the publishes catch up.
		if err := s.sendStatus(softCtx); err != nil {
			return err
		}
	}
	txn := s.cur
	txn.chunks.Add(1)
	s.r.batches.Add(1)
	// Each row takes its place in its aggregate's order here, in the
	// order decoded, and is published once the one before it is done.
	c := s.r.order.enter(rows)
	go func() {
		defer s.r.batches.Done()
		defer s.r.slots.Release(n)
		defer txn.chunks.Done()
		defer s.r.order.abandon(c) // a no-op for the rows done
		// Every row of a transaction is dispatched at its commit or after
		// it (a chunk that filled up earlier waits here the same way).
		if err := s.r.visibility.wait(softCtx, txn.xid); err != nil {
			txn.abandoned.Store(true)
			return
		}
		if len(refetch) > 0 {
			kept, ok := s.r.refetchCaptured(softCtx, rows, refetch)
			if !ok {
				txn.abandoned.Store(true)
				return
			}
			c = s.r.order.keep(c, kept)
		}
		if !s.r.publishOrdered(softCtx, hardCtx, c) {
			txn.abandoned.Store(true)
		}
	}()
	return nil
}

// publishCaptured publishes rows decoded from the slot until every one has
// a PubAck or is marked failed: the slot is not confirmed past them before,
// so a publish that fails for a reason outside the row (NATS down, the
// stream unavailable) is retried with backoff, for as long as it takes. It
// returns the ids it marked failed, and false if the relay stopped first.
func (r *Relay) publishCaptured(softCtx, hardCtx context.Context, rows []row) (failed map[int64]bool, ok bool) {
	wait := r.cfg.RetryMin
	for {
		if len(rows) == 0 {
			return failed, true
		}
		results, ok := r.publishAll(hardCtx, rows)
		if !ok {
			return nil, false
		}
		var (
			retry            []row
			failedIDs        []int64
			failedReasons    []string
			published        []Published
			firstRetryReason string
		)
		for i, res := range results {
			switch {
			case res.acked:
				published = append(published, Published{ID: rows[i].ID, CreatedAt: rows[i].CreatedAt.Time, AckedAt: res.ackedAt, Duplicate: res.duplicate})
			case res.permanent:
				failedIDs = append(failedIDs, rows[i].ID)
				failedReasons = append(failedReasons, res.err)
			default:
				if retry == nil {
					firstRetryReason = res.err
				}
				retry = append(retry, rows[i])
			}
		}
		r.reportPublished(published, len(retry), len(failedIDs))
		if len(failedIDs) > 0 {
			if !r.failCaptured(softCtx, failedIDs, failedReasons) {
				return nil, false
			}
			if failed == nil {
				failed = map[int64]bool{}
			}
			for _, id := range failedIDs {
				failed[id] = true
			}
		}
		if len(retry) == 0 {
			return failed, true
		}
		r.obs.Retried(len(retry))
		r.logger.Warn("publish failed; retrying, the slot waits for these rows", "rows", len(retry), "first_id", retry[0].ID, "error", firstRetryReason, "retry_in", wait)
		if !r.sleep(softCtx, wait) {
			return nil, false
		}
		wait = min(wait*2, r.cfg.RetryMax)
		rows = retry
	}
}

// failCaptured marks rows failed, retrying while Postgres is unreachable.
//
// The walsender may decode a commit a moment before the transaction is
// visible to other sessions, so a row the update did not find is looked
// for again, for a while, before it is taken as deleted since.
func (r *Relay) failCaptured(ctx context.Context, ids []int64, reasons []string) bool {
	missing := map[int64]string{}
	for i, id := range ids {
		missing[id] = reasons[i]
	}
	invisibleSince := time.Now()
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		var ids []int64
		var reasons []string
		for id, reason := range missing {
			ids, reasons = append(ids, id), append(reasons, reason)
		}
		marked, err := r.store.FailUnclaimed(ctx, ids, reasons)
		if err != nil {
			return struct{}{}, err
		}
		for _, id := range marked {
			delete(missing, id)
		}
		if len(missing) > 0 && time.Since(invisibleSince) < visibleWithin {
			return struct{}{}, errNotVisibleYet
		}
		return struct{}{}, nil
	}, backoff.WithBackOff(postgresRetry()), backoff.WithMaxElapsedTime(0), backoff.WithNotify(func(err error, next time.Duration) {
		if !errors.Is(err, errNotVisibleYet) {
			r.logger.Warn("mark unpublishable rows failed, will retry", "error", err, "retry_in", next, "rows", len(ids))
		}
	}))
	if err != nil {
		return false
	}
	for id := range missing {
		r.logger.Warn("an unpublishable row decoded from the slot is no longer in the outbox (deleted since?): not marked failed", "event_id", id, "reason", missing[id])
	}
	r.obs.Failed(len(ids) - len(missing))
	for i, id := range ids {
		if _, gone := missing[id]; !gone {
			r.logger.Error("outbox row can never be published: marked failed", "event_id", id, "reason", reasons[i])
		}
	}
	return true
}

// refetchCaptured reads again, from the table, the rows at indexes refetch:
// an update that did not touch a value stored out of line (TOAST) decodes
// without it. A row no longer pending and unpublished (claimed by a poll
// relay, marked, deleted since) is left out: whoever changed it owns it.
func (r *Relay) refetchCaptured(ctx context.Context, rows []row, refetch []int) ([]row, bool) {
	ids := make([]int64, len(refetch))
	for i, at := range refetch {
		ids[i] = rows[at].ID
	}
	fresh, err := backoff.Retry(ctx, func() ([]row, error) {
		return r.store.Unpublished(ctx, ids)
	}, backoff.WithBackOff(postgresRetry()), backoff.WithMaxElapsedTime(0), backoff.WithNotify(func(err error, next time.Duration) {
		r.logger.Warn("read updated outbox rows again, will retry", "error", err, "retry_in", next, "rows", len(ids))
	}))
	if err != nil {
		return nil, false
	}
	byID := make(map[int64]row, len(fresh))
	for _, f := range fresh {
		byID[f.ID] = f
	}
	kept := make([]row, 0, len(rows))
	next := 0
	for i, rw := range rows {
		if next < len(refetch) && refetch[next] == i {
			next++
			f, ok := byID[rw.ID]
			if !ok {
				r.logger.Warn("an updated outbox row decoded without its payload is no longer pending when read again (claimed, marked or deleted since): not published by the slot", "event_id", rw.ID)
				continue
			}
			rw = f
		}
		kept = append(kept, rw)
	}
	return kept, true
}

// postgresRetry is the backoff of a wal relay's calls to Postgres that
// must succeed before the slot moves on.
func postgresRetry() *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{
		InitialInterval: 10 * time.Millisecond, RandomizationFactor: 0.3, Multiplier: 2, MaxInterval: 2 * time.Second,
	}
}

// tupleState says what a decoded outbox row version is to the relay.
type tupleState int

const (
	tuplePending    tupleState = iota // publish it
	tupleNotPending                   // claimed, sent, failed: not the relay's to publish
	tupleToasted                      // pending, but a value is missing: read the row again
	tupleSkipped                      // skipped by an operator: not published, and it releases its aggregate
)

// errUnchangedToast: a column's value was not decoded, as an update left
// it unchanged and it is stored out of line.
var errUnchangedToast = errors.New("unchanged TOAST value")

// tupleRow reads an inserted or updated outbox row from its text-format
// tuple, into the same types the claim reads (nothing is judged here:
// message() does), and says whether it is pending.
func tupleRow(types *pgtype.Map, rel *relationColumns, t *pglogrepl.TupleData) (row, tupleState, error) {
	col := func(name string) (*pglogrepl.TupleDataColumn, error) {
		i := rel.index[name]
		if t == nil || i >= len(t.Columns) {
			return nil, fmt.Errorf("decoded outbox row has no column %s", name)
		}
		return t.Columns[i], nil
	}
	text := func(name string) (string, error) {
		c, err := col(name)
		if err != nil {
			return "", err
		}
		switch c.DataType {
		case pglogrepl.TupleDataTypeText:
			return string(c.Data), nil
		case pglogrepl.TupleDataTypeToast:
			return "", errUnchangedToast
		}
		return "", fmt.Errorf("decoded outbox row: column %s is not in text form (type %q)", name, c.DataType)
	}
	var rw row
	idText, err := text("id")
	if err != nil {
		return rw, 0, err
	}
	if rw.ID, err = strconv.ParseInt(idText, 10, 64); err != nil {
		return rw, 0, fmt.Errorf("decoded outbox row: id %q: %w", idText, err)
	}
	published, err := col("published_at")
	if err != nil {
		return rw, 0, err
	}
	status, err := text("status")
	switch {
	case errors.Is(err, errUnchangedToast):
		return rw, tupleToasted, nil
	case err != nil:
		return rw, 0, err
	case status == "skipped":
		// An operator gave up on a failed event: it no longer holds its
		// aggregate (see aggregateOrder).
		rw.AggregateType, _ = text("aggregate_type")
		rw.AggregateID, _ = text("aggregate_id")
		return rw, tupleSkipped, nil
	case status != "pending" || published.DataType != pglogrepl.TupleDataTypeNull:
		return rw, tupleNotPending, nil
	}
	for name, dst := range map[string]*string{"aggregate_type": &rw.AggregateType, "aggregate_id": &rw.AggregateID, "event_type": &rw.EventType} {
		if *dst, err = text(name); err != nil {
			break
		}
	}
	var payload, headers, created string
	if err == nil {
		payload, err = text("payload")
	}
	if err == nil {
		headers, err = text("headers")
	}
	if err == nil {
		created, err = text("created_at")
	}
	if errors.Is(err, errUnchangedToast) {
		return row{ID: rw.ID}, tupleToasted, nil
	}
	if err != nil {
		return rw, 0, err
	}
	rw.Payload, rw.Headers = []byte(payload), []byte(headers)
	// Text in the walsender's DateStyle (ISO); an unreadable value stays
	// invalid, and message() fails the row, not the stream.
	_ = types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, []byte(created), &rw.CreatedAt)
	// Absent from a relation decoded before schema migration 00009, and
	// null on rows written before it.
	if _, ok := rel.index["aggregate_seq"]; ok {
		if c, err := col("aggregate_seq"); err == nil && c.DataType == pglogrepl.TupleDataTypeText {
			if n, err := strconv.ParseInt(string(c.Data), 10, 64); err == nil {
				rw.AggregateSeq = pgtype.Int8{Int64: n, Valid: true}
			}
		}
	}
	return rw, tuplePending, nil
}
