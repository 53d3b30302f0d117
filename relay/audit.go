package relay

// The auditor: the stream answers to Postgres (DESIGN.md, invariant 11).
//
// A PubAck is not proof that a message will still be in the stream
// tomorrow. JetStream acknowledges a message before it syncs it to disk
// (sync_interval, 2 minutes unless set), so a server that loses power, or
// all the replicas of a stream losing their unsynced tail, or a disk that
// loses its last writes, loses events the relay has marked sent. The
// outbox holds every event for relay.sent_retention after its publish;
// the auditor checks the stream against it and publishes again what the
// stream lost, with the event's identity, so that the subscribers'
// checkpoints absorb it where they had seen it.
//
// Every publish records where the event landed (outbox_landings: its
// stream sequence, from the PubAck; with the batch's outcomes in poll
// capture, before the slot moves past it in wal capture). One relay at a
// time audits (a session advisory lock; the others stand by):
//
//   - tail: each landing once its events are older than relay.audit_delay
//     (longer than the server's sync_interval: a message found then was on
//     disk, so a later crash does not lose it);
//   - lookback: when the auditor starts, and after a sign that the stream
//     may have lost messages (the relay's connection reconnected, the
//     stream's leader changed, its last sequence went back), every landing
//     newer than relay.audit_lookback, at once;
//   - range: before a range of the outbox is dropped, every row it
//     published, with or without a landing (fanout_outbox_retire keeps the
//     range until an audit of it passed since its last publish).
//
// An event is in the stream when the message at its sequence carries its
// Nats-Msg-Id. A message a direct get does not find is asked of the
// stream's leader (a replica may be behind), and an event published again
// since is looked for where it landed last; what is still missing is
// published again from its row, its new landing recorded, and each repair
// logged with the row and the sequence. fanout audit runs the same checks
// on demand.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
)

// Kinds of audit (outbox_audits.kind, the metrics' kind label).
const (
	AuditTail     = "tail"
	AuditLookback = "lookback"
	AuditRange    = "range"
	AuditCommand  = "command"
	// AuditReplay counts, in the metrics only, what a wal relay found
	// missing as it decoded again events it had published (replayed).
	AuditReplay = "replay"
)

// auditor checks the stream against the outbox and publishes again what
// the stream lost. One relay's auditor at a time audits (run); fanout
// audit makes one of its own (Audit).
type auditor struct {
	*core
	// consumer is the consumer the audit reads runs of consumerRead
	// sequences or more through (stream.AuditConsumer; fanout audit's is
	// stream.AuditCommandConsumer; none for a stream several databases share,
	// whose auditors would take each other's).
	consumer     string
	consumerRead uint64
	// lease checks, while this auditor audits, that it still holds the
	// audit lock (a long pass checks it between windows).
	lease func(context.Context) error
}

func newAuditor(c *core) *auditor {
	a := &auditor{core: c, consumer: stream.AuditConsumer, consumerRead: consumerRead}
	if c.stream.Databases == stream.SeveralDatabases {
		a.consumer = ""
	}
	return a
}

// auditLockKey names the advisory lock the auditing relay holds;
// auditCommandLockKey the one fanout audit holds (its consumer is one).
const (
	auditLockKey        = "fanout_outbox_audit"
	auditCommandLockKey = "fanout_outbox_audit_command"
)

// commandLock takes fanout audit's lock on a connection of its own, for
// as long as the returned release is not called, or says another one runs.
func (a *auditor) commandLock(ctx context.Context) (release func(), err error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := pgx.ConnectConfig(cctx, a.pool.Config().ConnConfig.Copy())
	cancel()
	if err != nil {
		return nil, fmt.Errorf("connect for fanout audit's lock: %w", err)
	}
	closeConn := func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx) // the lock goes with the session
	}
	var locked bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtext($1))`, auditCommandLockKey).Scan(&locked); err != nil {
		closeConn()
		return nil, fmt.Errorf("take fanout audit's lock: %w", err)
	}
	if !locked {
		closeConn()
		return nil, errors.New("another fanout audit is running (it holds the advisory lock fanout_outbox_audit_command)")
	}
	return closeConn, nil
}

// auditChunk is how many landings one pass of the tail or lookback audit
// reads at a time (each a batch of up to relay.batch_size events).
const auditChunk = 200

// run audits while this relay holds the audit lock, and stands by
// while another does.
func (a *auditor) run(ctx context.Context) {
	for ctx.Err() == nil {
		err := a.asLeader(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			a.logger.Warn("auditor: stopped auditing; trying again", "error", err, "retry_in", a.cfg.AuditInterval)
		}
		if !sleepFor(ctx, a.cfg.AuditInterval) {
			return
		}
	}
}

// sleepFor waits d or until ctx ends; false if it ended.
func sleepFor(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// asLeader takes the audit lock on a connection of its own (held as
// long as the connection lives: a relay that dies gives it up) and audits
// every relay.audit_interval until the connection breaks or ctx ends.
func (a *auditor) asLeader(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := pgx.ConnectConfig(cctx, a.pool.Config().ConnConfig.Copy())
	cancel()
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	for {
		var locked bool
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := conn.QueryRow(qctx, `SELECT pg_try_advisory_lock(hashtext($1))`, auditLockKey).Scan(&locked)
		cancel()
		if err != nil {
			return fmt.Errorf("take the audit lock: %w", err)
		}
		if locked {
			break
		}
		if !sleepFor(ctx, a.cfg.AuditInterval) {
			return nil
		}
	}
	a.lease = func(ctx context.Context) error {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := conn.Ping(pctx); err != nil {
			return fmt.Errorf("the audit lock's connection: %w", err)
		}
		return nil
	}
	defer func() { a.lease = nil }()
	a.logger.Info("auditing the stream against the outbox", "stream", a.stream.Name,
		"interval", a.cfg.AuditInterval, "delay", a.cfg.AuditDelay, "lookback", a.cfg.AuditLookback)
	signs := a.lossSigns(ctx, lossSigns{})
	// A lookback that could not finish (the stream still electing its
	// leader after the loss, Postgres restarting) is tried again at every
	// pass until it does: the sign that asked for it is not seen twice.
	lookback := "the auditor started"
	if a.lookback(ctx, lookback) {
		lookback = ""
	}
	retryRange := map[string]time.Time{}
	for {
		if !sleepFor(ctx, a.cfg.AuditInterval) {
			return nil
		}
		if err := a.stillAuditor(ctx); err != nil {
			return err
		}
		next := a.lossSigns(ctx, signs)
		if why := next.since(signs); why != "" {
			a.logger.Warn("the stream may have lost messages: auditing the recent events again", "why", why, "lookback", a.cfg.AuditLookback)
			lookback = why
		}
		signs = next
		if lookback != "" && a.lookback(ctx, lookback) {
			lookback = ""
		}
		a.tail(ctx)
		a.ranges(ctx, retryRange)
	}
}

// lossSigns is what the auditor watches for signs of a loss.
type lossSigns struct {
	known      bool
	reconnects uint64
	leader     string
	lastSeq    uint64
}

// lossSigns reads them now (prev where the stream does not answer).
func (a *auditor) lossSigns(ctx context.Context, prev lossSigns) lossSigns {
	now := prev
	now.reconnects = a.nc.Stats().Reconnects
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s, err := a.js.Stream(ctx, a.stream.Name)
	if err != nil {
		return now
	}
	info := s.CachedInfo()
	now.known, now.lastSeq, now.leader = true, info.State.LastSeq, ""
	if info.Cluster != nil {
		now.leader = info.Cluster.Leader
	}
	return now
}

// since says what changed from prev that may mean a loss, or "".
func (s lossSigns) since(prev lossSigns) string {
	switch {
	case s.reconnects > prev.reconnects:
		return "the relay's connection to NATS reconnected (a server restarted?)"
	case !prev.known || !s.known:
		return ""
	case s.lastSeq < prev.lastSeq:
		return fmt.Sprintf("the stream's last sequence went back from %d to %d", prev.lastSeq, s.lastSeq)
	case prev.leader != "" && s.leader != "" && s.leader != prev.leader:
		return fmt.Sprintf("the stream's leader changed from %s to %s", prev.leader, s.leader)
	}
	return ""
}

// auditTail checks the landings not yet checked whose events are older
// than relay.audit_delay.
func (a *auditor) tail(ctx context.Context) {
	st, err := a.store.AuditState(ctx)
	if err != nil {
		a.failed(AuditTail, err)
		return
	}
	began := time.Now()
	var total AuditReport
	after := st.TailLanding
	for ctx.Err() == nil {
		if err := a.stillAuditor(ctx); err != nil {
			a.failed(AuditTail, err)
			break
		}
		ls, err := a.store.TailLandings(ctx, a.stream.Name, after, a.cfg.AuditDelay, auditChunk)
		if err != nil {
			a.failed(AuditTail, err)
			break
		}
		if len(ls) == 0 {
			break
		}
		rep, err := a.verify(ctx, eventsOf(ls), nil, true)
		total.add(rep)
		if err != nil {
			a.failed(AuditTail, err)
			break
		}
		after = ls[len(ls)-1].ID
		if err := a.store.AdvanceTail(ctx, after); err != nil {
			a.failed(AuditTail, err)
			break
		}
	}
	a.done(ctx, AuditTail, fmt.Sprintf("landings %d..%d", st.TailLanding+1, after), began, total)
}

// lookbackUnfinished ends the scope of a lookback recorded part done (it
// is tried again).
const lookbackUnfinished = "did not finish, tried again"

// auditLookback checks every landing newer than relay.audit_lookback, and
// says whether it finished.
func (a *auditor) lookback(ctx context.Context, why string) bool {
	began := time.Now()
	since := began.Add(-a.cfg.AuditLookback)
	var rep AuditReport
	var err error
	if a.hooks.FailLookback != nil && a.hooks.FailLookback() {
		err = errors.New("test hook: the stream did not answer")
	} else {
		rep, err = a.landings(ctx, since, began, true)
	}
	scope := fmt.Sprintf("events published since %s (%s)", since.UTC().Format(time.RFC3339), why)
	if err != nil {
		a.failed(AuditLookback, err)
		scope += "; " + lookbackUnfinished
	}
	a.done(ctx, AuditLookback, scope, began, rep)
	return err == nil
}

// auditLandings checks every landing from since to before (its own
// repairs land after it), a chunk at a time.
func (a *auditor) landings(ctx context.Context, since, before time.Time, repair bool) (AuditReport, error) {
	var total AuditReport
	var after int64
	for ctx.Err() == nil {
		if err := a.stillAuditor(ctx); err != nil {
			return total, err
		}
		ls, err := a.store.Landings(ctx, a.stream.Name, after, since, before, auditChunk)
		if err != nil {
			return total, err
		}
		if len(ls) == 0 {
			break
		}
		rep, err := a.verify(ctx, eventsOf(ls), nil, repair)
		total.add(rep)
		if err != nil {
			return total, err
		}
		after = ls[len(ls)-1].ID
	}
	return total, ctx.Err()
}

// auditRanges audits the ranges waiting for an audit before their drop.
// A range that needed repairs, or holds a copy too young to be on disk,
// is audited again once it is older than relay.audit_delay.
func (a *auditor) ranges(ctx context.Context, notBefore map[string]time.Time) {
	ps, err := a.store.PartitionsToAudit(ctx)
	if err != nil {
		a.failed(AuditRange, err)
		return
	}
	for _, p := range ps {
		if time.Now().Before(notBefore[p.Name]) {
			continue
		}
		rep, passed, err := a.auditRange(ctx, p.Partition, p.Due, true, nil)
		if err != nil {
			a.failed(AuditRange, err)
			return
		}
		if !passed {
			notBefore[p.Name] = time.Now().Add(max(a.cfg.AuditDelay, a.cfg.AuditInterval))
			a.logger.Info("outbox range audited, not yet passed: kept", "range", p.Name, "missing", rep.Missing, "repaired", rep.Repaired)
		} else {
			delete(notBefore, p.Name)
		}
	}
}

// auditWindow is how many ids of a range one pass reads: the audit of a
// large range holds a window's events at a time.
const auditWindow = 200_000

// auditRange checks every published row of the range p, last published at
// due, a window of ids at a time, and records the audit. It passes when
// nothing was missing, no row was on its way to the stream, and every
// landing it checked was older than relay.audit_delay (a repair's copy may
// not be on disk yet); with repair set, a range with a name that passes is
// recorded audited (it may then be dropped). A range without a name is
// only checked (fanout audit's).
func (a *auditor) auditRange(ctx context.Context, p outboxstore.Partition, due time.Time, repair bool,
	progress func(done, of int64, rep AuditReport)) (rep AuditReport, passed bool, err error) {
	began, err := a.store.Now(ctx)
	if err != nil {
		return AuditReport{}, false, err
	}
	st, err := a.store.AuditState(ctx)
	if err != nil {
		return AuditReport{}, false, err
	}
	lower := st.FromID
	if p.Lower != nil {
		lower = max(lower, *p.Lower)
	}
	passed = true
	for lo := lower; lo < p.Upper; lo += auditWindow {
		if err := a.stillAuditor(ctx); err != nil {
			return rep, false, err
		}
		hi := min(lo+auditWindow, p.Upper)
		w, err := a.store.RangeEvents(ctx, a.stream.Name, a.stream.SubjectPrefix, lo, hi, st.FromID, a.cfg.Capture == CaptureWAL, due)
		if err != nil {
			return rep, false, err
		}
		part, err := a.verify(ctx, w.Events, w.Contents, repair)
		rep.add(part)
		if err != nil {
			return rep, false, err
		}
		if w.Unsettled > 0 || part.Missing > 0 || part.Altered > 0 || w.Youngest.After(began.Add(-a.cfg.AuditDelay)) {
			passed = false
		}
		if progress != nil {
			progress(hi-lower, p.Upper-lower, rep)
		}
	}
	scope := "range " + p.Name
	if p.Name == "" {
		scope = fmt.Sprintf("ids %d..%d", lower, p.Upper-1)
	}
	kind := AuditRange
	if progress != nil {
		kind = AuditCommand
	}
	a.done(ctx, kind, scope, began, rep)
	if passed && repair && p.Name != "" {
		if err := a.store.MarkAudited(ctx, p.Name, began); err != nil {
			return rep, false, err
		}
		a.logger.Info("outbox range audited: every event is in the stream; it may be dropped", "range", p.Name, "events", rep.Checked)
	}
	return rep, passed, nil
}

// stillAuditor says whether this relay still holds the audit lock, for a
// pass that runs long (nil when it is not the auditor, but fanout audit).
func (a *auditor) stillAuditor(ctx context.Context) error {
	if a.lease == nil {
		return nil
	}
	return a.lease(ctx)
}

// Audit checks the stream against the outbox once, as the auditor does,
// and publishes again what is missing unless dryRun (fanout audit): the
// events that landed since since, or, with since zero, every published
// row the outbox holds. progress is told after each window of ids.
func Audit(ctx context.Context, opts Options, since time.Time, dryRun bool, progress func(what string, done, of int64, rep AuditReport)) (AuditReport, error) {
	r, err := New(opts)
	if err != nil {
		return AuditReport{}, err
	}
	a := r.auditor
	ident, err := a.store.ReadIdentity(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	a.origin.identity.Store(ident)
	if err := a.origin.checkOwner(ctx); err != nil {
		return AuditReport{}, err
	}
	a.consumer = stream.AuditCommandConsumer
	release, err := a.commandLock(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	defer release()
	if !since.IsZero() {
		began := time.Now()
		rep, err := a.landings(ctx, since, began, !dryRun)
		a.done(ctx, AuditCommand, "events published since "+since.UTC().Format(time.RFC3339), began, rep)
		return rep, err
	}
	lastID, err := a.store.LastID(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	now, err := a.store.Now(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	// Every id the outbox handed out, whatever range holds it (or none:
	// outbox_default); the auditor marks the ranges it audits itself.
	rep, _, err := a.auditRange(ctx, outboxstore.Partition{Upper: lastID + 1}, now, !dryRun, func(done, of int64, rep AuditReport) {
		if progress != nil {
			progress("outbox ids", done, of, rep)
		}
	})
	return rep, err
}

func eventsOf(ls []outboxstore.Landing) []outboxstore.Landed {
	var out []outboxstore.Landed
	for _, l := range ls {
		out = append(out, l.Events...)
	}
	return out
}

func (a *auditor) failed(kind string, err error) {
	a.logger.Warn("audit: could not finish; the next pass goes on", "kind", kind, "error", err)
}

// auditDone reports an audit that checked anything.
func (a *auditor) done(ctx context.Context, kind, scope string, began time.Time, rep AuditReport) {
	if rep.Checked == 0 {
		return
	}
	level := a.logger.Debug
	switch {
	case rep.Altered > 0:
		level = a.logger.Error
	case rep.Missing > 0:
		level = a.logger.Warn
	}
	level("audit done", "kind", kind, "scope", scope, "checked", rep.Checked, "missing", rep.Missing, "repaired", rep.Repaired, "altered", rep.Altered,
		"took", time.Since(began).Round(time.Millisecond))
	rec := outboxstore.Audit{Kind: kind, Scope: scope, StartedAt: began, Checked: rep.Checked, Missing: rep.Missing, Repaired: rep.Repaired, Detail: rep.detail()}
	if err := a.store.RecordAudit(ctx, rec); err != nil {
		a.logger.Warn("audit: record it", "error", err)
	}
	// Reported after the record, so that whoever hears of an audit finds
	// it in outbox_audits (a loaded test run read the table in between).
	a.obs.Audited(kind, int(rep.Checked), int(rep.Missing), int(rep.Repaired))
	if rep.Altered > 0 {
		a.obs.AuditAltered(kind, int(rep.Altered))
	}
}
