package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/jackc/pglogrepl"
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

// walCapture is the relay's capture from the write-ahead log
// (relay.capture wal): it streams the outbox's committed rows from a
// logical replication slot and publishes them in commit order, each
// aggregate's events in theirs (relay/doc.go, "Capture from the
// write-ahead log"). A poll relay has one too, to finish a switch from
// wal capture before its first claim (handover.go).
type walCapture struct {
	*core
	pub      *publisher
	delivery *delivery   // the slot's backlog, claimed event by event
	tx       *txDelivery // the slot's backlog, claimed by transactions
	// order keeps each aggregate's events in order through the
	// concurrent publishes.
	order      *aggregateOrder
	visibility *visibilityGate

	state          atomic.Int32  // captureConnecting, captureStandby, captureStreaming
	confirmedLSN   atomic.Uint64 // the last position confirmed to the server
	confirmedAt    atomic.Int64  // unix nanoseconds of the last confirm over a transaction
	backlogThrough atomic.Int64  // the slot's backlog bound, -1 until known
	backlogDone    atomic.Bool   // every row up to the bound was published
	slot           atomic.Pointer[SlotState]
	slotCheckEvery time.Duration // slotCheckInterval; tests shorten it

	// testHookBeforeConfirm, when set, runs after every row of a
	// transaction has its PubAck and before the slot may be confirmed
	// past it.
	testHookBeforeConfirm func(ctx context.Context, end pglogrepl.LSN)
	// testHookChunk, when set, runs as each chunk's publishing begins.
	testHookChunk func(rows []row)
}

func newWALCapture(c *core, pub *publisher, d *delivery, tx *txDelivery) *walCapture {
	w := &walCapture{core: c, pub: pub, delivery: d, tx: tx, order: newAggregateOrder(),
		visibility: &visibilityGate{pool: c.pool}, slotCheckEvery: slotCheckInterval}
	w.backlogThrough.Store(-1)
	return w
}

// run keeps one replication stream from the slot open while the relay
// runs: it reconnects after any failure and stands by while another relay
// holds the slot (Postgres lets one connection stream from a slot at a time,
// and a relay that dies releases it as its connection closes).
func (w *walCapture) run(softCtx, hardCtx context.Context) {
	wait := 100 * time.Millisecond
	for softCtx.Err() == nil {
		err := w.streamSlot(softCtx, hardCtx, 0)
		if softCtx.Err() != nil {
			return
		}
		w.touch()
		msg := err.Error()
		w.lastClaimErr.Store(&msg)
		w.origin.markStale() // Postgres may be back from a restore
		switch {
		case errors.Is(err, errSlotInUse):
			if w.state.Swap(captureStandby) != captureStandby {
				w.logger.Info("standing by: another relay streams from the slot", "slot", w.cfg.Slot, "detail", err)
			}
			wait = 100 * time.Millisecond
			if !w.sleep(softCtx, standbyRetry) {
				return
			}
			continue
		case errors.Is(err, errSlotLost):
			w.state.Store(captureConnecting)
			w.logger.Error("replication slot invalidated", "slot", w.cfg.Slot, "error", err)
		default:
			w.state.Store(captureConnecting)
			w.logger.Error("stream from the replication slot", "slot", w.cfg.Slot, "error", err, "retry_in", wait)
		}
		if !w.sleep(softCtx, wait) {
			return
		}
		wait = min(wait*2, 5*time.Second)
	}
}

// errReachedUntil ends a stream that confirmed the position it was asked
// to reach.
var errReachedUntil = errors.New("the slot is confirmed past the position asked for")

// streamSlot streams from the slot until ctx ends or the stream fails, or,
// with until set, until the slot is confirmed at least that far (the slot
// must exist then, and rows from before it are not claimed).
func (w *walCapture) streamSlot(softCtx, hardCtx context.Context, until pglogrepl.LSN) error {
	conn, err := w.replicationConn(softCtx)
	if err != nil {
		return err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()

	backlog, err := w.ensureSlot(softCtx, conn, until == 0)
	if err != nil {
		return err
	}
	if until != 0 {
		backlog.Done = true // claimed by the poll relay that asked
	}
	// Rows committed before the slot existed are not in its stream: they
	// are published by claiming them, as the poll relay does, and all of
	// them before the stream starts: an aggregate's older event claimed
	// from the backlog would otherwise enter the stream after its newer
	// one decoded from the slot (the fault run caught one). The slot
	// keeps the WAL meanwhile.
	if !backlog.Done {
		w.drainBacklog(softCtx, hardCtx, backlog)
		if !w.backlogDone.Load() { // the relay is stopping
			return cmp.Or(softCtx.Err(), errors.New("relay stopping before the slot's backlog was published"))
		}
	}
	if err := w.startReplication(softCtx, conn); err != nil {
		return err
	}
	if w.state.Swap(captureStreaming) != captureStreaming {
		w.logger.Info("streaming from the replication slot", "slot", w.cfg.Slot, "publication", Publication)
	}
	w.touch()

	var drain sync.WaitGroup // the watcher below
	defer drain.Wait()
	// The failed events that hold their aggregates (relay.on_failed hold),
	// as the table has them now: the stream starts from the confirmed
	// position, and marked them failed before it.
	if w.store.OnFailed != outboxstore.SkipFailed {
		loadCtx, cancel := context.WithTimeout(softCtx, 10*time.Second)
		err := w.order.loadHolds(loadCtx, w.store)
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
	// The chunks in flight finish at a graceful stop (softCtx ends), on
	// hardCtx: what they publish is then confirmed, and the relay that
	// takes the slot next does not publish it again (nor, confirmed past
	// a transaction one of them left, everything after it). A server
	// stopping abandons them with the stream: the next stream decodes
	// them again.
	flight, endFlight := context.WithCancelCause(hardCtx)
	defer endFlight(nil)
	landedCtx, cancel := context.WithTimeout(softCtx, 10*time.Second)
	landedThrough, err := w.store.LandedThrough(landedCtx, w.stream.Name)
	cancel()
	if err != nil {
		return err
	}
	s := &walStream{w: w, conn: conn, relations: map[uint32]*relationColumns{}, types: pgtype.NewMap(), queue: make(chan *walTxn, w.cfg.MaxInFlight+64), until: until,
		landedThrough: landedThrough, flight: flight}
	s.progressAt.Store(time.Now().UnixNano())
	drain.Add(1)
	go func() {
		defer drain.Done()
		s.watchServerStopping(streamCtx, func(cause error) { endFlight(cause); endStream(cause) })
	}()
	err = s.run(streamCtx, hardCtx)
	if cause := context.Cause(streamCtx); err == nil && softCtx.Err() == nil && cause != nil {
		err = cause
	}
	return err
}

// replicationConn opens a replication connection to the relay's database.
func (w *walCapture) replicationConn(ctx context.Context) (*pgconn.PgConn, error) {
	cc := w.pool.Config().ConnConfig.Config.Copy()
	if cc.RuntimeParams == nil {
		cc.RuntimeParams = map[string]string{}
	}
	cc.RuntimeParams["replication"] = "database"
	connectCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgconn.ConnectConfig(connectCtx, cc)
	if err != nil {
		return nil, fmt.Errorf("replication connection: %w", err)
	}
	return conn, nil
}

// startReplication starts the slot's stream on conn; a slot another
// relay streams from is errSlotInUse.
func (w *walCapture) startReplication(ctx context.Context, conn *pgconn.PgConn) error {
	startCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := pglogrepl.StartReplication(startCtx, conn, w.cfg.Slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + Publication + "'"},
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use: "replication slot ... is active for PID ..."
			return fmt.Errorf("%w: %s", errSlotInUse, pgErr.Message)
		}
		return fmt.Errorf("start replication from slot %s: %w", w.cfg.Slot, err)
	}
	return nil
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
		_, err := s.w.pool.Exec(pingCtx, "SELECT 1")
		cancel()
		if serverStopping(err) {
			s.w.logger.Warn("Postgres is shutting down: closing the replication stream so that it can stop", "slot", s.w.cfg.Slot, "error", err)
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

// walTxn is one decoded transaction: its rows are published in chunks, and
// the slot may be confirmed past it once every chunk is done.
type walTxn struct {
	xid       uint32        // its transaction id, for the visibility gate
	final     pglogrepl.LSN // its commit record's position, from its begin: names it
	parts     int           // chunks dispatched (the decoder's alone)
	lastPart  chan struct{} // closed when the last chunk dispatched is done (relay.atomic transaction)
	end       pglogrepl.LSN // the end of its commit record, set at commit
	commitAt  time.Time
	chunks    sync.WaitGroup // the commit, and each chunk in flight
	abandoned atomic.Bool    // a chunk stopped before all its rows were published
}

// walStream is one open replication stream.
type walStream struct {
	w         *walCapture
	conn      *pgconn.PgConn
	relations map[uint32]*relationColumns
	types     *pgtype.Map // not safe for concurrent use: one per stream
	cur       *walTxn
	rows      []row         // the current transaction's rows not yet dispatched
	refetch   []int         // indexes in rows of versions decoded without a value (unchanged TOAST), ascending
	rowAt     map[int64]int // id -> index in rows

	until pglogrepl.LSN // end the stream once confirmed this far (0: never)
	// landedThrough: the highest event id with a landing when the stream
	// started. The stream starts from the slot's confirmed position, which
	// lags what was published: rows up to it may be decoded again, and
	// their landings are looked up (replayed).
	landedThrough int64
	// flight ends the chunks in flight: hardCtx, or the server stopping
	// (streamSlot).
	flight     context.Context
	queue      chan *walTxn  // transactions in commit order, to confirm
	queued     atomic.Int64  // transactions in queue or being waited on
	confirmed  atomic.Uint64 // the position safe to confirm
	progressAt atomic.Int64  // unix nanoseconds when a transaction was last confirmed, or the queue last empty
	stopped    atomic.Bool   // the confirmer met an abandoned transaction
}

func (s *walStream) run(softCtx, hardCtx context.Context) (err error) {
	w := s.w
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
		w.touch()
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
	s.w.confirmedLSN.Store(uint64(pos))
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
		if h := s.w.testHookBeforeConfirm; h != nil {
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
		s.w.confirmedAt.Store(time.Now().UnixNano())
		s.progressAt.Store(time.Now().UnixNano())
		s.queued.Add(-1)
	}
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
