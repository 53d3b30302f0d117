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
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
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

// AuditReport is what one audit checked and found.
type AuditReport struct {
	// Checked events; Missing from the stream (or published with no
	// landing recorded, Unrecorded of them); Repaired, published again;
	// AgedOut: below the stream's first sequence (its own limits removed
	// them), not missing.
	Checked, Missing, Unrecorded, Repaired, AgedOut int64
	// Lost: missing events whose rows are gone too, which no repair can
	// bring back (the first few).
	Lost []int64
}

func (a *AuditReport) add(b AuditReport) {
	a.Checked += b.Checked
	a.Missing += b.Missing
	a.Unrecorded += b.Unrecorded
	a.Repaired += b.Repaired
	a.AgedOut += b.AgedOut
	a.Lost = append(a.Lost, b.Lost...)
	if len(a.Lost) > maxLostListed {
		a.Lost = a.Lost[:maxLostListed]
	}
}

const maxLostListed = 20

func (a AuditReport) detail() string {
	var parts []string
	if a.Unrecorded > 0 {
		parts = append(parts, fmt.Sprintf("%d published with no landing recorded", a.Unrecorded))
	}
	if a.AgedOut > 0 {
		parts = append(parts, fmt.Sprintf("%d below the stream's first sequence (removed by its limits)", a.AgedOut))
	}
	if a.Missing > a.Repaired {
		parts = append(parts, fmt.Sprintf("%d not repaired", a.Missing-a.Repaired))
	}
	if len(a.Lost) > 0 {
		parts = append(parts, fmt.Sprintf("rows gone for events %v", a.Lost))
	}
	return strings.Join(parts, "; ")
}

// auditLockKey names the advisory lock the auditing relay holds;
// auditCommandLockKey the one fanout audit holds (its consumer is one).
const (
	auditLockKey        = "fanout_outbox_audit"
	auditCommandLockKey = "fanout_outbox_audit_command"
)

// commandLock takes fanout audit's lock on a connection of its own, for
// as long as the returned release is not called, or says another one runs.
func (r *Relay) commandLock(ctx context.Context) (release func(), err error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := pgx.ConnectConfig(cctx, r.pool.Config().ConnConfig.Copy())
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

// auditLoop audits while this relay holds the audit lock, and stands by
// while another does.
func (r *Relay) auditLoop(ctx context.Context) {
	for ctx.Err() == nil {
		err := r.auditAsLeader(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			r.logger.Warn("auditor: stopped auditing; trying again", "error", err, "retry_in", r.cfg.AuditInterval)
		}
		if !r.sleepFor(ctx, r.cfg.AuditInterval) {
			return
		}
	}
}

// sleepFor waits d or until ctx ends; false if it ended.
func (r *Relay) sleepFor(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// auditAsLeader takes the audit lock on a connection of its own (held as
// long as the connection lives: a relay that dies gives it up) and audits
// every relay.audit_interval until the connection breaks or ctx ends.
func (r *Relay) auditAsLeader(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := pgx.ConnectConfig(cctx, r.pool.Config().ConnConfig.Copy())
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
		if !r.sleepFor(ctx, r.cfg.AuditInterval) {
			return nil
		}
	}
	r.auditLease = func(ctx context.Context) error {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := conn.Ping(pctx); err != nil {
			return fmt.Errorf("the audit lock's connection: %w", err)
		}
		return nil
	}
	defer func() { r.auditLease = nil }()
	r.logger.Info("auditing the stream against the outbox", "stream", r.stream.Name,
		"interval", r.cfg.AuditInterval, "delay", r.cfg.AuditDelay, "lookback", r.cfg.AuditLookback)
	signs := r.lossSigns(ctx, lossSigns{})
	// A lookback that could not finish (the stream still electing its
	// leader after the loss, Postgres restarting) is tried again at every
	// pass until it does: the sign that asked for it is not seen twice.
	lookback := "the auditor started"
	if r.auditLookback(ctx, lookback) {
		lookback = ""
	}
	retryRange := map[string]time.Time{}
	for {
		if !r.sleepFor(ctx, r.cfg.AuditInterval) {
			return nil
		}
		if err := r.stillAuditor(ctx); err != nil {
			return err
		}
		next := r.lossSigns(ctx, signs)
		if why := next.since(signs); why != "" {
			r.logger.Warn("the stream may have lost messages: auditing the recent events again", "why", why, "lookback", r.cfg.AuditLookback)
			lookback = why
		}
		signs = next
		if lookback != "" && r.auditLookback(ctx, lookback) {
			lookback = ""
		}
		r.auditTail(ctx)
		r.auditRanges(ctx, retryRange)
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
func (r *Relay) lossSigns(ctx context.Context, prev lossSigns) lossSigns {
	now := prev
	now.reconnects = r.nc.Stats().Reconnects
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s, err := r.js.Stream(ctx, r.stream.Name)
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
func (r *Relay) auditTail(ctx context.Context) {
	st, err := r.store.AuditState(ctx)
	if err != nil {
		r.auditFailed(AuditTail, err)
		return
	}
	began := time.Now()
	var total AuditReport
	after := st.TailLanding
	for ctx.Err() == nil {
		if err := r.stillAuditor(ctx); err != nil {
			r.auditFailed(AuditTail, err)
			break
		}
		ls, err := r.store.TailLandings(ctx, r.stream.Name, after, r.cfg.AuditDelay, auditChunk)
		if err != nil {
			r.auditFailed(AuditTail, err)
			break
		}
		if len(ls) == 0 {
			break
		}
		rep, err := r.verify(ctx, eventsOf(ls), true)
		total.add(rep)
		if err != nil {
			r.auditFailed(AuditTail, err)
			break
		}
		after = ls[len(ls)-1].ID
		if err := r.store.AdvanceTail(ctx, after); err != nil {
			r.auditFailed(AuditTail, err)
			break
		}
	}
	r.auditDone(ctx, AuditTail, fmt.Sprintf("landings %d..%d", st.TailLanding+1, after), began, total)
}

// lookbackUnfinished ends the scope of a lookback recorded part done (it
// is tried again).
const lookbackUnfinished = "did not finish, tried again"

// auditLookback checks every landing newer than relay.audit_lookback, and
// says whether it finished.
func (r *Relay) auditLookback(ctx context.Context, why string) bool {
	began := time.Now()
	since := began.Add(-r.cfg.AuditLookback)
	var rep AuditReport
	var err error
	if r.hooks.FailLookback != nil && r.hooks.FailLookback() {
		err = errors.New("test hook: the stream did not answer")
	} else {
		rep, err = r.auditLandings(ctx, since, began, true)
	}
	scope := fmt.Sprintf("events published since %s (%s)", since.UTC().Format(time.RFC3339), why)
	if err != nil {
		r.auditFailed(AuditLookback, err)
		scope += "; " + lookbackUnfinished
	}
	r.auditDone(ctx, AuditLookback, scope, began, rep)
	return err == nil
}

// auditLandings checks every landing from since to before (its own
// repairs land after it), a chunk at a time.
func (r *Relay) auditLandings(ctx context.Context, since, before time.Time, repair bool) (AuditReport, error) {
	var total AuditReport
	var after int64
	for ctx.Err() == nil {
		if err := r.stillAuditor(ctx); err != nil {
			return total, err
		}
		ls, err := r.store.Landings(ctx, r.stream.Name, after, since, before, auditChunk)
		if err != nil {
			return total, err
		}
		if len(ls) == 0 {
			break
		}
		rep, err := r.verify(ctx, eventsOf(ls), repair)
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
func (r *Relay) auditRanges(ctx context.Context, notBefore map[string]time.Time) {
	ps, err := r.store.PartitionsToAudit(ctx)
	if err != nil {
		r.auditFailed(AuditRange, err)
		return
	}
	for _, p := range ps {
		if time.Now().Before(notBefore[p.Name]) {
			continue
		}
		rep, passed, err := r.AuditRange(ctx, p.Partition, p.Due, true, nil)
		if err != nil {
			r.auditFailed(AuditRange, err)
			return
		}
		if !passed {
			notBefore[p.Name] = time.Now().Add(max(r.cfg.AuditDelay, r.cfg.AuditInterval))
			r.logger.Info("outbox range audited, not yet passed: kept", "range", p.Name, "missing", rep.Missing, "repaired", rep.Repaired)
		} else {
			delete(notBefore, p.Name)
		}
	}
}

// auditWindow is how many ids of a range one pass reads: the audit of a
// large range holds a window's events at a time.
const auditWindow = 200_000

// AuditRange checks every published row of the range p, last published at
// due, a window of ids at a time, and records the audit. It passes when
// nothing was missing, no row was on its way to the stream, and every
// landing it checked was older than relay.audit_delay (a repair's copy may
// not be on disk yet); with repair set, a range with a name that passes is
// recorded audited (it may then be dropped). A range without a name is
// only checked (fanout audit's).
func (r *Relay) AuditRange(ctx context.Context, p outbox.Partition, due time.Time, repair bool,
	progress func(done, of int64, rep AuditReport)) (rep AuditReport, passed bool, err error) {
	began, err := r.store.Now(ctx)
	if err != nil {
		return AuditReport{}, false, err
	}
	st, err := r.store.AuditState(ctx)
	if err != nil {
		return AuditReport{}, false, err
	}
	lower := st.FromID
	if p.Lower != nil {
		lower = max(lower, *p.Lower)
	}
	passed = true
	for lo := lower; lo < p.Upper; lo += auditWindow {
		if err := r.stillAuditor(ctx); err != nil {
			return rep, false, err
		}
		hi := min(lo+auditWindow, p.Upper)
		w, err := r.store.RangeEvents(ctx, r.stream.Name, lo, hi, st.FromID, r.cfg.Capture == CaptureWAL, due)
		if err != nil {
			return rep, false, err
		}
		part, err := r.verify(ctx, w.Events, repair)
		rep.add(part)
		if err != nil {
			return rep, false, err
		}
		if w.Unsettled > 0 || part.Missing > 0 || w.Youngest.After(began.Add(-r.cfg.AuditDelay)) {
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
	r.auditDone(ctx, kind, scope, began, rep)
	if passed && repair && p.Name != "" {
		if err := r.store.MarkAudited(ctx, p.Name, began); err != nil {
			return rep, false, err
		}
		r.logger.Info("outbox range audited: every event is in the stream; it may be dropped", "range", p.Name, "events", rep.Checked)
	}
	return rep, passed, nil
}

// stillAuditor says whether this relay still holds the audit lock, for a
// pass that runs long (nil when it is not the auditor, but fanout audit).
func (r *Relay) stillAuditor(ctx context.Context) error {
	if r.auditLease == nil {
		return nil
	}
	return r.auditLease(ctx)
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
	ident, err := r.store.ReadIdentity(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	r.identity.Store(ident)
	if err := r.checkOwner(ctx); err != nil {
		return AuditReport{}, err
	}
	r.auditConsumer = AuditCommandConsumer
	release, err := r.commandLock(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	defer release()
	if !since.IsZero() {
		began := time.Now()
		rep, err := r.auditLandings(ctx, since, began, !dryRun)
		r.auditDone(ctx, AuditCommand, "events published since "+since.UTC().Format(time.RFC3339), began, rep)
		return rep, err
	}
	lastID, err := r.store.LastID(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	now, err := r.store.Now(ctx)
	if err != nil {
		return AuditReport{}, err
	}
	// Every id the outbox handed out, whatever range holds it (or none:
	// outbox_default); the auditor marks the ranges it audits itself.
	rep, _, err := r.AuditRange(ctx, outbox.Partition{Upper: lastID + 1}, now, !dryRun, func(done, of int64, rep AuditReport) {
		if progress != nil {
			progress("outbox ids", done, of, rep)
		}
	})
	return rep, err
}

func eventsOf(ls []outbox.Landing) []outbox.Landed {
	var out []outbox.Landed
	for _, l := range ls {
		out = append(out, l.Events...)
	}
	return out
}

func (r *Relay) auditFailed(kind string, err error) {
	r.logger.Warn("audit: could not finish; the next pass goes on", "kind", kind, "error", err)
}

// auditDone reports an audit that checked anything.
func (r *Relay) auditDone(ctx context.Context, kind, scope string, began time.Time, rep AuditReport) {
	if rep.Checked == 0 {
		return
	}
	level := r.logger.Debug
	if rep.Missing > 0 {
		level = r.logger.Warn
	}
	level("audit done", "kind", kind, "scope", scope, "checked", rep.Checked, "missing", rep.Missing, "repaired", rep.Repaired,
		"took", time.Since(began).Round(time.Millisecond))
	a := outbox.Audit{Kind: kind, Scope: scope, StartedAt: began, Checked: rep.Checked, Missing: rep.Missing, Repaired: rep.Repaired, Detail: rep.detail()}
	if err := r.store.RecordAudit(ctx, a); err != nil {
		r.logger.Warn("audit: record it", "error", err)
	}
	// Reported after the record, so that whoever hears of an audit finds
	// it in outbox_audits (a loaded test run read the table in between).
	r.obs.Audited(kind, int(rep.Checked), int(rep.Missing), int(rep.Repaired))
}

// auditGap is the widest gap between two audited sequences read through
// rather than asked for apart.
const auditGap = 256

// verify checks that each event of ls is in the stream at its sequence
// with its identity (sequence 0: no landing recorded, missing), and with
// repair publishes again those that are not.
func (r *Relay) verify(ctx context.Context, ls []outbox.Landed, repair bool) (AuditReport, error) {
	rep := AuditReport{Checked: int64(len(ls))}
	if len(ls) == 0 {
		return rep, nil
	}
	// The identity as the database has it now: a relay that has not
	// published since another began an epoch holds an older one.
	ident, err := r.store.ReadIdentity(ctx)
	if err != nil {
		return rep, err
	}
	// The newest landing of each event (ls are in landing order).
	newest := make(map[int64]int, len(ls))
	for i, l := range ls {
		newest[l.ID] = i
	}
	pairs := make([]outbox.Landed, 0, len(newest))
	for i, l := range ls {
		if newest[l.ID] == i {
			pairs = append(pairs, l)
		}
	}
	rep.Checked = int64(len(pairs))
	slices.SortFunc(pairs, func(a, b outbox.Landed) int { return cmpSeq(a.Seq, b.Seq) })
	s, err := r.js.Stream(ctx, r.stream.Name)
	if err != nil {
		return rep, fmt.Errorf("look up stream %s: %w", r.stream.Name, err)
	}
	var suspects []outbox.Landed
	i := 0
	for i < len(pairs) && pairs[i].Seq == 0 {
		suspects = append(suspects, pairs[i])
		rep.Unrecorded++
		i++
	}
	// Below the stream's first sequence: removed by the stream's own
	// limits (max_age, max_bytes), not lost; the subscribers had them.
	first := s.CachedInfo().State.FirstSeq
	for i < len(pairs) && pairs[i].Seq < first {
		rep.AgedOut++
		i++
	}
	for i < len(pairs) {
		// One run: sequences no more than auditGap apart, read through.
		j := i + 1
		for j < len(pairs) && pairs[j].Seq-pairs[j-1].Seq <= auditGap {
			j++
		}
		run := pairs[i:j]
		k := 0
		err := readRange(ctx, r.js, s, r.auditConsumer, r.consumerRead, run[0].Seq, run[len(run)-1].Seq, func(m *jetstream.RawStreamMsg) bool {
			for k < len(run) && run[k].Seq < m.Sequence {
				suspects = append(suspects, run[k]) // no message at its sequence
				k++
			}
			for k < len(run) && run[k].Seq == m.Sequence {
				if m.Header.Get(jetstream.MsgIDHeader) != outbox.MsgID(ident.OriginOf(run[k].ID), run[k].ID) {
					suspects = append(suspects, run[k])
				}
				k++
			}
			return k < len(run)
		})
		if err != nil {
			return rep, err
		}
		suspects = append(suspects, run[k:]...)
		i = j
	}
	if len(suspects) == 0 {
		return rep, nil
	}
	missing, err := r.confirmMissing(ctx, ident, suspects)
	if err != nil {
		return rep, err
	}
	rep.Missing = int64(len(missing))
	if len(missing) == 0 || !repair {
		return rep, nil
	}
	// A repair publishes, as the relay does: not into a stream another
	// database owns or that holds an epoch this database does not know,
	// and with the identity a due restore check may have just changed.
	if err := r.guardOrigin(ctx); err != nil {
		return rep, fmt.Errorf("not publishing the %d missing events again: %w", len(missing), err)
	}
	repaired, lost, err := r.repair(ctx, r.identity.Load(), missing)
	rep.Repaired, rep.Lost = int64(repaired), lost
	return rep, err
}

func cmpSeq(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// confirmMissing keeps the suspects that are missing indeed: not at their
// sequence as the stream's leader sees it (a replica a direct get reached
// may be behind), nor where they landed last (published again since).
func (r *Relay) confirmMissing(ctx context.Context, ident *outbox.Identity, suspects []outbox.Landed) ([]outbox.Landed, error) {
	ids := make([]int64, len(suspects))
	for i, l := range suspects {
		ids[i] = l.ID
	}
	latest, err := r.store.NewestLandings(ctx, r.stream.Name, ids)
	if err != nil {
		return nil, err
	}
	// What the leader holds: a sequence past its last one is missing
	// without asking (after a rollback, most of them are).
	s, err := r.js.Stream(ctx, r.stream.Name)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	leaderLast := info.State.LastSeq
	var missing []outbox.Landed
	for _, l := range suspects {
		seqs := []uint64{l.Seq}
		if last := latest[l.ID]; last != l.Seq {
			seqs = append(seqs, last)
		}
		found := false
		for _, seq := range seqs {
			if seq == 0 || seq > leaderLast {
				continue
			}
			m, ok, err := leaderGet(ctx, r.nc, r.stream.Name, seq)
			if err != nil {
				return nil, err
			}
			if ok && m.Header.Get(jetstream.MsgIDHeader) == outbox.MsgID(ident.OriginOf(l.ID), l.ID) {
				found = true
				break
			}
		}
		if !found {
			missing = append(missing, l)
		}
	}
	return missing, nil
}

// repair publishes the missing events again from their rows, with their
// identity, and records where they landed. Rows gone too are lost.
func (r *Relay) repair(ctx context.Context, ident *outbox.Identity, missing []outbox.Landed) (repaired int, lost []int64, err error) {
	was := make(map[int64]uint64, len(missing))
	for _, l := range missing {
		was[l.ID] = l.Seq
	}
	maxPayload := r.nc.MaxPayload()
	for len(missing) > 0 {
		part := missing[:min(len(missing), r.cfg.BatchSize)]
		missing = missing[len(part):]
		ids := make([]int64, len(part))
		for i, l := range part {
			ids[i] = l.ID
		}
		chunk, err := r.store.Rows(ctx, ids)
		if err != nil {
			return repaired, lost, err
		}
		have := make(map[int64]bool, len(chunk))
		for _, rw := range chunk {
			have[rw.ID] = true
		}
		for _, id := range ids {
			if !have[id] {
				lost = append(lost, id)
				r.logger.Error("audit: an event is missing from the stream and its outbox row is gone: it cannot be published again",
					"event_id", id, "stream_seq", was[id])
			}
		}
		futures := make([]jetstream.PubAckFuture, len(chunk))
		for i, rw := range chunk {
			msg, err := Message(r.stream, ident, rw, maxPayload)
			if err != nil {
				r.logger.Error("audit: an event missing from the stream cannot be published again", "event_id", rw.ID, "error", err)
				continue
			}
			msg.Header[outbox.RepairedHeader] = []string{strconv.FormatUint(was[rw.ID], 10)}
			if futures[i], err = r.js.PublishMsgAsync(msg); err != nil {
				return repaired, lost, fmt.Errorf("publish event %d again: %w", rw.ID, err)
			}
		}
		var landed []outbox.Landed
		for i, f := range futures {
			if f == nil {
				continue
			}
			select {
			case ack := <-f.Ok():
				landed = append(landed, outbox.Landed{ID: chunk[i].ID, Seq: ack.Sequence})
				r.logger.Warn("audit: an event was missing from the stream: published again",
					"event_id", chunk[i].ID, "stream_seq", was[chunk[i].ID], "new_stream_seq", ack.Sequence, "duplicate", ack.Duplicate)
			case err := <-f.Err():
				return repaired, lost, fmt.Errorf("publish event %d again: %w", chunk[i].ID, err)
			case <-ctx.Done():
				return repaired, lost, ctx.Err()
			}
		}
		if err := r.store.RecordLandings(ctx, r.stream.Name, landed); err != nil {
			return repaired, lost, err
		}
		repaired += len(landed)
	}
	if len(lost) > maxLostListed {
		lost = lost[:maxLostListed]
	}
	return repaired, lost, nil
}
