package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"
)

// relationColumns maps the outbox's columns to their places in a tuple.
type relationColumns struct {
	outbox bool
	index  map[string]int
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
		s.cur = &walTxn{xid: m.Xid, final: m.FinalLSN}
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
		if err := s.dispatch(softCtx, hardCtx, true); err != nil {
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
		s.w.order.release(rw)
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
	if s.w.cfg.Atomic == AtomicTransaction && len(s.rows) == atomicMax {
		// A full chunk goes once a row follows it: the commit's is then
		// never empty, and its events say they are the last.
		if err := s.dispatch(softCtx, hardCtx, false); err != nil {
			return err
		}
	}
	if state == tupleToasted {
		s.refetch = append(s.refetch, len(s.rows))
	}
	if s.rowAt == nil {
		s.rowAt = map[int64]int{}
	}
	s.rowAt[rw.ID] = len(s.rows)
	s.rows = append(s.rows, rw)
	if s.w.cfg.Atomic != AtomicTransaction && len(s.rows) >= s.w.cfg.BatchSize {
		return s.dispatch(softCtx, hardCtx, false)
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
	tu := tuple{rel: rel, t: t}
	var rw row
	idText, err := tu.text("id")
	if err != nil {
		return rw, 0, err
	}
	if rw.ID, err = strconv.ParseInt(idText, 10, 64); err != nil {
		return rw, 0, fmt.Errorf("decoded outbox row: id %q: %w", idText, err)
	}
	published, err := tu.col("published_at")
	if err != nil {
		return rw, 0, err
	}
	status, err := tu.text("status")
	switch {
	case errors.Is(err, errUnchangedToast):
		return rw, tupleToasted, nil
	case err != nil:
		return rw, 0, err
	case status == "skipped":
		// An operator gave up on a failed event: it no longer holds its
		// aggregate (see aggregateOrder).
		rw.AggregateType, _ = tu.text("aggregate_type")
		rw.AggregateID, _ = tu.text("aggregate_id")
		return rw, tupleSkipped, nil
	case status != "pending" || published.DataType != pglogrepl.TupleDataTypeNull:
		return rw, tupleNotPending, nil
	}
	err = tu.readEvent(types, &rw)
	if errors.Is(err, errUnchangedToast) {
		return row{ID: rw.ID}, tupleToasted, nil
	}
	if err != nil {
		return rw, 0, err
	}
	return rw, tuplePending, nil
}

// tuple is one decoded version of an outbox row, its columns by name.
type tuple struct {
	rel *relationColumns
	t   *pglogrepl.TupleData
}

func (tu tuple) col(name string) (*pglogrepl.TupleDataColumn, error) {
	i := tu.rel.index[name]
	if tu.t == nil || i >= len(tu.t.Columns) {
		return nil, fmt.Errorf("decoded outbox row has no column %s", name)
	}
	return tu.t.Columns[i], nil
}

// text is a column's text; errUnchangedToast for a value stored out of
// line that the update did not touch (decoded without it).
func (tu tuple) text(name string) (string, error) {
	c, err := tu.col(name)
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

// readEvent reads a pending row's event into rw: its aggregate, type,
// payload, headers, creation time and number.
func (tu tuple) readEvent(types *pgtype.Map, rw *row) error {
	var err error
	for name, dst := range map[string]*string{"aggregate_type": &rw.AggregateType, "aggregate_id": &rw.AggregateID, "event_type": &rw.EventType} {
		if *dst, err = tu.text(name); err != nil {
			return err
		}
	}
	var payload, headers, created string
	if payload, err = tu.text("payload"); err != nil {
		return err
	}
	if headers, err = tu.text("headers"); err != nil {
		return err
	}
	if created, err = tu.text("created_at"); err != nil {
		return err
	}
	rw.Payload, rw.Headers = []byte(payload), []byte(headers)
	// Text in the walsender's DateStyle (ISO); an unreadable value stays
	// invalid, and the publisher fails the row, not the stream.
	_ = types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, []byte(created), &rw.CreatedAt)
	// Absent from a relation decoded before schema migration 00009, and
	// null on rows written before it.
	if _, ok := tu.rel.index["aggregate_seq"]; ok {
		if c, err := tu.col("aggregate_seq"); err == nil && c.DataType == pglogrepl.TupleDataTypeText {
			if n, err := strconv.ParseInt(string(c.Data), 10, 64); err == nil {
				rw.AggregateSeq = pgtype.Int8{Int64: n, Valid: true}
			}
		}
	}
	return nil
}
