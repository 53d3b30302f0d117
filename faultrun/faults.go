package faultrun

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// resourceLocks keep two faults off one resource at a time: a short cut
// of the search engine must not end a long outage of it early.
type resourceLocks struct {
	postgres, search, redis, deadLetters, nats sync.Mutex
}

// Nominal lengths of the long outages; a run shorter than three times one
// scales it down to a third of the run (CI's short runs).
const (
	postgresOutage    = time.Minute
	redisOutage       = time.Minute
	searchOutage      = 3 * time.Minute
	deadLetterOutage  = time.Minute
	snapshotHeldFor   = 2 * time.Minute
	rolledBackAfter   = time.Minute
	longOutageDivisor = 3
)

// faults injects short faults every few seconds until ctx ends and, once
// each, the long outages at seeded times in between.
func (r *run) faults(ctx context.Context) {
	var wg sync.WaitGroup
	if len(r.o.KillOnly) == 0 || r.o.RollBack {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.longOutages(ctx)
		}()
	}
	r.shortFaults(ctx)
	wg.Wait()
}

func (r *run) shortFaults(ctx context.Context) {
	type fault struct {
		name   string
		weight int
		do     func(context.Context) bool // false: not injected (its resource was busy)
	}
	natsKill := "nats-server killed and restarted"
	if r.o.Cluster {
		natsKill = "cluster node killed and restarted"
	}
	all := []fault{
		{"role process killed (kill -9) and restarted", 5, r.killRole},
		{natsKill, 2, r.killNATS},
		{"postgres restarted (pg_ctl restart -m immediate)", 1, r.restartPostgres},
		{"search engine unreachable (seconds)", 1, r.cutSearch},
		{"slow network to NATS", 1, r.slowNATS},
		{"NATS connections cut", 1, r.cutNATS},
	}
	minGap, maxGap := 2*time.Second, 5*time.Second
	if len(r.o.KillOnly) > 0 {
		all = all[:1]
		minGap, maxGap = time.Second, 3*time.Second
	}
	total := 0
	for _, f := range all {
		total += f.weight
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(r.faultRand.between(minGap, maxGap)):
		}
		n := r.faultRand.intn(total)
		for _, f := range all {
			if n < f.weight {
				if f.do(ctx) {
					r.countFault(f.name)
				}
				break
			}
			n -= f.weight
		}
	}
}

func (r *run) countFault(name string) {
	r.faultsMu.Lock()
	r.report.Faults[name]++
	r.faultsMu.Unlock()
}

// longOutages runs each long outage once, starting at a seeded time such
// that it ends before the load does.
func (r *run) longOutages(ctx context.Context) {
	outages := []struct {
		name    string
		nominal time.Duration
		do      func(ctx context.Context, d time.Duration)
	}{
		{"postgres stopped", postgresOutage, r.stopPostgres},
		{"redis unreachable", redisOutage, r.redisDown},
		{"search engine unreachable", searchOutage, r.searchDown},
		{"dead-letter stream unavailable", deadLetterOutage, r.deadLettersDown},
		{"a transaction holding its snapshot open", snapshotHeldFor, r.holdSnapshot},
		{"JetStream losing the messages it acknowledged (its stores rolled back)", rolledBackAfter, r.rollBackJetStream},
	}
	if len(r.o.KillOnly) > 0 { // a self-test of the rollback: only it
		outages = outages[len(outages)-1:]
	}
	var wg sync.WaitGroup
	for _, o := range outages {
		d := min(o.nominal, r.o.Duration/longOutageDivisor)
		start := r.longRand.between(0, r.o.Duration-d)
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-ctx.Done():
				return
			case <-time.After(start):
			}
			r.o.Logf("chaos: %s for %s", o.name, d)
			o.do(ctx, d)
			r.countFault(o.name + " for " + d.String())
		}()
	}
	wg.Wait()
}

// sleepCtx waits d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

func (r *run) killRole(context.Context) bool {
	r.rolesMu.Lock()
	roles := slices.Clone(r.roles)
	r.rolesMu.Unlock()
	candidates := roles
	if len(r.o.KillOnly) > 0 {
		candidates = nil
		for _, role := range roles {
			if slices.ContainsFunc(r.o.KillOnly, func(p string) bool { return strings.HasPrefix(role.Name, p) }) {
				candidates = append(candidates, role)
			}
		}
	}
	if len(candidates) == 0 {
		return false // the late subscriber's roles, before they join
	}
	role := candidates[r.faultRand.intn(len(candidates))]
	role.Kill()
	time.Sleep(r.faultRand.between(200*time.Millisecond, 2*time.Second))
	if err := role.Start(); err != nil {
		r.o.Logf("chaos: restart %s: %v", role.Name, err)
	}
	return true
}

func (r *run) killNATS(ctx context.Context) bool {
	if !r.locks.nats.TryLock() {
		return false
	}
	defer r.locks.nats.Unlock()
	victim := r.nats[r.faultRand.intn(len(r.nats))]
	if r.o.Cluster && r.faultRand.intn(2) == 0 {
		// The stream leader, half the time. A short deadline: the admin
		// connection may itself be reconnecting.
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if s, err := r.js.Stream(ctx, "EVENTS"); err == nil {
			if info, err := s.Info(ctx); err == nil && info.Cluster != nil {
				for i := range r.nats {
					if "n"+strconv.Itoa(i+1) == info.Cluster.Leader {
						victim = r.nats[i]
					}
				}
			}
		}
	}
	victim.Kill()
	time.Sleep(r.faultRand.between(time.Second, 3*time.Second))
	if err := victim.Restart(); err != nil {
		r.o.Logf("chaos: restart nats-server: %v", err)
	}
	return true
}

func (r *run) restartPostgres(context.Context) bool {
	if !r.locks.postgres.TryLock() {
		return false
	}
	defer r.locks.postgres.Unlock()
	if err := r.pg.RestartImmediate(); err != nil {
		r.o.Logf("chaos: restart postgres: %v", err)
	}
	return true
}

func (r *run) cutSearch(context.Context) bool {
	if !r.locks.search.TryLock() {
		return false
	}
	defer r.locks.search.Unlock()
	r.sproxy.Cut()
	time.Sleep(r.faultRand.between(3*time.Second, 8*time.Second))
	r.sproxy.Restore()
	return true
}

func (r *run) slowNATS(context.Context) bool {
	if !r.locks.nats.TryLock() { // the proxies are the store rollback's
		return false
	}
	defer r.locks.nats.Unlock()
	d := r.faultRand.between(20*time.Millisecond, 150*time.Millisecond)
	for _, p := range r.nproxy {
		p.Slow(d)
	}
	time.Sleep(r.faultRand.between(3*time.Second, 6*time.Second))
	for _, p := range r.nproxy {
		p.Restore()
	}
	return true
}

func (r *run) cutNATS(context.Context) bool {
	if !r.locks.nats.TryLock() {
		return false
	}
	defer r.locks.nats.Unlock()
	p := r.nproxy[r.faultRand.intn(len(r.nproxy))]
	p.Cut()
	time.Sleep(r.faultRand.between(500*time.Millisecond, 3*time.Second))
	p.Restore()
	return true
}

// stopPostgres stops the server (pg_ctl stop -m fast) for d: every role,
// the writers and the checkpoints lose it at once.
func (r *run) stopPostgres(ctx context.Context, d time.Duration) {
	r.locks.postgres.Lock()
	defer r.locks.postgres.Unlock()
	if err := r.pg.Stop(); err != nil {
		r.o.Logf("chaos: stop postgres: %v", err)
	}
	sleepCtx(ctx, d)
	for attempt := 0; ; attempt++ {
		err := r.pg.Start()
		if err == nil {
			return
		}
		if attempt == 10 {
			r.report.violate("setup", "postgres did not start again after its outage: "+err.Error())
			return
		}
		r.o.Logf("chaos: start postgres: %v", err)
		time.Sleep(time.Second)
	}
}

func (r *run) redisDown(ctx context.Context, d time.Duration) {
	r.locks.redis.Lock()
	defer r.locks.redis.Unlock()
	r.rproxy.Cut()
	sleepCtx(ctx, d)
	r.rproxy.Restore()
}

func (r *run) searchDown(ctx context.Context, d time.Duration) {
	r.locks.search.Lock()
	defer r.locks.search.Unlock()
	r.sproxy.Cut()
	sleepCtx(ctx, d)
	r.sproxy.Restore()
}

// deadLettersDown moves the DEADLETTER stream off its subjects for d, so
// every dead-letter publish finds no stream (and its messages stay), and
// plants a poison order right then: it must wait, unacked, and arrive once
// the stream is back. A subscriber that restarts meanwhile re-applies the
// stream's configuration (with subscribers.dead_letter_provision auto, on
// the single server), so the fault re-applies its own every second.
func (r *run) deadLettersDown(ctx context.Context, d time.Duration) {
	r.locks.deadLetters.Lock()
	defer r.locks.deadLetters.Unlock()
	var orig jetstream.StreamConfig
	err := tryEverySecond(func() bool { return ctx.Err() != nil }, func(ictx context.Context) error {
		s, err := r.jsDL.Stream(ictx, "DEADLETTER")
		if err == nil {
			orig = s.CachedInfo().Config
		}
		return err
	})
	if err != nil {
		return // the run ended first
	}
	parked := orig
	parked.Subjects = []string{"parked.deadletter.>"}
	park := func() {
		uctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := r.jsDL.UpdateStream(uctx, parked); err != nil {
			r.o.Logf("chaos: park the dead-letter stream: %v", err)
		}
	}
	park()
	if err := r.plantMalformedOrder(ctx); err != nil && ctx.Err() == nil {
		r.o.Logf("chaos: plant a poison during the dead-letter outage: %v", err)
	}
	until := time.Now().Add(d)
	for time.Now().Before(until) && ctx.Err() == nil {
		sleepCtx(ctx, time.Second)
		park()
	}
	deadline := time.Now().Add(time.Minute)
	if err := tryEverySecond(func() bool { return time.Now().After(deadline) }, func(uctx context.Context) error {
		_, err := r.jsDL.UpdateStream(uctx, orig)
		return err
	}); err != nil {
		r.report.violate("setup", "the dead-letter stream could not be restored: "+err.Error())
	}
}

// rollBackJetStream makes JetStream lose messages it acknowledged. Every
// server's store is copied (each server stopped for the copy, as a disk
// image is taken), and after d the servers are killed, their stores put
// back as the copy has them (a disk that lost every write since), and
// started again: the events acknowledged in between are gone from the
// stream, and the consumers' positions go back with it. Every node of a
// cluster: a majority alone would have the leader's log to catch up from.
func (r *run) rollBackJetStream(ctx context.Context, d time.Duration) {
	r.locks.nats.Lock()
	defer r.locks.nats.Unlock()
	r.locks.deadLetters.Lock() // the store holds the dead-letter stream's configuration too
	defer r.locks.deadLetters.Unlock()
	before, fromSeq := r.streamState()
	snapshots := r.copyStores()
	sleepCtx(ctx, d)
	// The roles' connections cut (they go through the proxies; this run's
	// administrator does not) before the last sequence is read: a publish
	// between the read and the kill would be lost from a sequence the
	// checker does not know was taken away.
	for _, p := range r.nproxy {
		p.Cut()
	}
	defer func() {
		for _, p := range r.nproxy {
			p.Restore()
		}
	}()
	time.Sleep(500 * time.Millisecond) // what the cut connections had sent, stored
	_, toSeq := r.streamState()
	killed := time.Now()
	r.onEveryServer("kill, roll its store back, start", func(s *natstest.Server) error {
		if s.Running() {
			s.Kill()
		}
		if err := s.RollBack(snapshots[s]); err != nil {
			return err
		}
		return s.Restart()
	})
	// What the restored stores hold (the roles cannot publish yet: their
	// proxies are cut). Below the sequence read before the copy if the
	// stop for the copy lost messages itself: they are lost to this fault
	// all the same.
	_, rolledTo := r.streamState()
	r.recordRollback(fromSeq, toSeq, rolledTo, killed)
	r.o.Logf("chaos: JetStream's stores rolled back %s: the stream held %d messages (last sequence %d) when its store was copied, %d after the rollback, and has lost what it acknowledged through sequence %d",
		d, before, fromSeq, rolledTo, toSeq)
	r.rejoinLate()
}

// onEveryServer runs fn on every nats-server at once, each tried up to 6
// times; one that still fails is a violation of the run's setup.
func (r *run) onEveryServer(what string, fn func(s *natstest.Server) error) {
	var wg sync.WaitGroup
	for _, s := range r.nats {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for attempt := 0; ; attempt++ {
				err := fn(s)
				if err == nil {
					return
				}
				if attempt == 5 {
					r.report.violate("setup", "nats-server "+what+": "+err.Error())
					return
				}
				r.o.Logf("chaos: nats-server %s: %v", what, err)
				time.Sleep(time.Second)
			}
		}()
	}
	wg.Wait()
}

// copyStores stops each server, copies its store (as a disk image is
// taken) and starts it again; it returns the copies.
func (r *run) copyStores() map[*natstest.Server]string {
	snapshots := make(map[*natstest.Server]string, len(r.nats))
	var mu sync.Mutex
	r.onEveryServer("stop, copy its store, start", func(s *natstest.Server) error {
		if s.Running() {
			s.Stop()
		}
		mu.Lock()
		_, taken := snapshots[s] // a retry after the copy only starts the server
		mu.Unlock()
		if !taken {
			snap, err := s.Snapshot()
			if err != nil {
				return err
			}
			mu.Lock()
			snapshots[s] = snap
			mu.Unlock()
		}
		return s.Restart()
	})
	return snapshots
}

// recordRollback records the sequences a store rollback took away (from
// after the lower of fromSeq, read before the copy, and rolledTo, read
// after the rollback, through toSeq, read before the kill), and when it
// killed the servers.
func (r *run) recordRollback(fromSeq, toSeq, rolledTo int64, killed time.Time) {
	if fromSeq >= 0 && toSeq >= 0 && rolledTo >= 0 {
		// The sequences the rollback took away: an event the auditor
		// publishes again was lost from one of them.
		r.lostMu.Lock()
		r.lostSpans = append(r.lostSpans, [2]uint64{uint64(min(fromSeq, rolledTo)) + 1, uint64(toSeq)})
		r.lostMu.Unlock()
	} else {
		r.report.violate("setup", "the stream's last sequence around the rollback could not be read")
	}
	r.lostMu.Lock()
	r.rolledBack = killed // a lookback begun since saw the rolled-back stores, or failed
	r.lostMu.Unlock()
}

// streamState is how many messages stream EVENTS holds and its last
// sequence (-1, -1: unknown), tried for up to 30 s (a cluster electing).
func (r *run) streamState() (msgs, lastSeq int64) {
	msgs, lastSeq = -1, -1
	deadline := time.Now().Add(30 * time.Second)
	_ = tryEverySecond(func() bool { return time.Now().After(deadline) }, func(ctx context.Context) error {
		s, err := r.js.Stream(ctx, "EVENTS")
		if err != nil {
			return err
		}
		msgs, lastSeq = int64(s.CachedInfo().State.Msgs), int64(s.CachedInfo().State.LastSeq)
		return nil
	})
	return msgs, lastSeq
}

// tryEverySecond calls fn, each call bounded by 5 s, until it succeeds or
// giveUp says so, and returns its last error.
func tryEverySecond(giveUp func() bool, fn func(ctx context.Context) error) error {
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := fn(ctx)
		cancel()
		if err == nil || giveUp() {
			return err
		}
		time.Sleep(time.Second)
	}
}

// holdSnapshot keeps a repeatable-read transaction open for d: the horizon
// it holds keeps every dead outbox row version alive meanwhile (as a long
// report or a stuck session would).
func (r *run) holdSnapshot(ctx context.Context, d time.Duration) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := pgx.Connect(cctx, r.db.URL)
	cancel()
	if err != nil {
		r.o.Logf("chaos: connect to hold a snapshot: %v", err)
		return
	}
	defer conn.Close(context.Background())
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		r.o.Logf("chaos: begin the snapshot: %v", err)
		return
	}
	var n int64
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil {
		r.o.Logf("chaos: take the snapshot: %v", err)
	}
	sleepCtx(ctx, d)
	_ = tx.Rollback(context.Background())
}
