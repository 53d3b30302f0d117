package faultrun

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/faultproxy"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/testca"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop/demo"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// Options configure a run.
type Options struct {
	Duration time.Duration // of the load and the faults
	Seed     uint64
	Cluster  bool // three nats-servers, stream replicas 3
	Rate     int  // writes per second
	Binary   string
	Logf     func(format string, args ...any)
	// Sabotage, for the checker's self-test, is passed to every role as
	// FANOUT_TEST_SABOTAGE (Binary must be built with the fanout_sabotage
	// tag): deliberately broken behaviour the checks must catch.
	Sabotage string
	// KillOnly, if set, restricts the role kills to roles with these
	// names' prefixes (the self-test kills the sabotaged roles).
	KillOnly []string
	// Subscribers are the subscribers run and checked (default: the
	// registry's); Binary must know them all.
	Subscribers []subscribers.Declaration
	// RollBack, in a run with KillOnly (a self-test), adds the fault
	// that rolls JetStream's stores back: the one long fault such a run
	// has.
	RollBack bool
	// Capture is the relays' relay.capture: poll (the default) or wal.
	// Relay kills then land anywhere, also between a publish and the
	// slot's confirmation.
	Capture string
	// Atomic is the relays' relay.atomic: event (the default) or
	// transaction (wal capture), which the checker then holds them to.
	Atomic string
	// Backfill names subscribers that join the run late (backfill.go): at
	// a third of the load, each one's processes start with a consumer that
	// takes only new events, and `fanout backfill` (killed like every
	// role) hands it what came before, from Postgres.
	Backfill []string
	// Unnumbered are event types the outbox does not number (outbox
	// numbering): their events must reach every subscriber as the others
	// do, and carry no number.
	Unnumbered []string
}

// wal reports whether the run's relays capture from the WAL: they leave
// the rows they publish `pending`.
func (r *run) wal() bool { return r.o.Capture == relay.CaptureWAL }

// instances is how many processes of a subscriber the run starts (2 unless
// listed): two share a consumer, so kills and redeliveries cross processes.
var instances = map[string]int{cacheinval.Name: 1}

func (r *run) subscriberNames() []string {
	names := make([]string, len(r.o.Subscribers))
	for i, d := range r.o.Subscribers {
		names[i] = d.Name
	}
	return names
}

// filters returns the event types subscriber name wants, and whether it is
// in the run.
func (r *run) filters(name string) ([]string, bool) {
	for _, d := range r.o.Subscribers {
		if d.Name == name {
			return d.EventTypes, true
		}
	}
	return nil, false
}

// run is one fault-injection run's world.
type run struct {
	t         *testing.T
	o         Options
	faultRand *seeded // which fault, where, when and for how long
	plantRand *seeded // the planted bad input
	readRand  *seeded // which products the cache reader reads
	longRand  *seeded // when the long outages start
	faultsMu  sync.Mutex
	pg        *pgtest.Server
	db        *pgtest.DB
	nats      []*natstest.Server
	nproxy    []*faultproxy.Proxy
	sproxy    *faultproxy.Proxy
	rproxy    *faultproxy.Proxy
	locks     resourceLocks
	rdb       *redis.Client
	search    *search.Client
	alias     string
	rolesMu   sync.Mutex // roles grows when the late subscribers join
	roles     []*Role
	late      []*lateSubscriber // Options.Backfill's (backfill.go)
	admin     *nats.Conn
	js        jetstream.JetStream // stream EVENTS, as its administrator
	adminDL   *nats.Conn
	jsDL      jetstream.JetStream // stream DEADLETTER, as its administrator
	// passwords of the cluster's users (the rendered cluster.conf
	// authenticates every client and route); nil on the single server,
	// which has no authentication.
	passwords map[string]string
	tls       testca.Pair // the cluster's; none on the single server
	logDir    string
	// lostSpans are the stream sequences the store rollbacks took away.
	lostMu    sync.Mutex
	lostSpans [][2]uint64
	// rolledBack is when the last store rollback began killing the
	// servers, zero without one.
	rolledBack time.Time
	report     *Report
	planted    *planted
}

// seeded is one stream of the run's randomness. Each consumer has its own
// stream, so the fault schedule a seed gives does not depend on how many
// numbers a timing-dependent loop (the cache reader) drew meanwhile: a
// failing seed replays the same faults.
type seeded struct {
	mu  sync.Mutex
	rng *rand.Rand
}

func newSeeded(seed, stream uint64) *seeded {
	return &seeded{rng: rand.New(rand.NewPCG(seed, stream))}
}

func (s *seeded) intn(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.IntN(n)
}

func (s *seeded) between(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(s.intn(int(hi-lo)/int(time.Millisecond)+1))*time.Millisecond
}

// Run executes one fault-injection run and returns its report. Setup
// failures fail t; invariant violations are in the report.
func Run(t *testing.T, o Options) *Report {
	if o.Subscribers == nil {
		o.Subscribers = registry.Default.All()
	}
	r := &run{t: t, o: o, planted: newPlanted(),
		faultRand: newSeeded(o.Seed, 3), plantRand: newSeeded(o.Seed, 4), readRand: newSeeded(o.Seed, 5), longRand: newSeeded(o.Seed, 6)}
	mode := "single nats-server"
	if o.Cluster {
		mode = "three-node JetStream cluster (replicas 3)"
	}
	r.report = &Report{Mode: mode, Seed: o.Seed, Duration: o.Duration, Faults: map[string]int{}}
	r.logDir = t.TempDir()
	if keep := os.Getenv("FANOUT_TEST_CHAOS_LOGS"); keep != "" {
		// The roles' logs kept after the run, a directory per run.
		r.logDir = filepath.Join(keep, strings.ReplaceAll(t.Name(), "/", "_"))
		if err := os.MkdirAll(r.logDir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Registered before setup: a setup that fails half-way (a role that
	// never came up) stops the roles it started all the same.
	t.Cleanup(r.teardown)
	r.setup()

	start := time.Now()
	ctx, stop := context.WithTimeout(context.Background(), o.Duration)
	var wg sync.WaitGroup
	wg.Add(4)
	go func() { defer wg.Done(); r.joinLate(ctx) }()
	go func() { defer wg.Done(); r.load(ctx) }()
	go func() { defer wg.Done(); r.readCache(ctx) }()
	go func() { defer wg.Done(); r.faults(ctx) }()
	wg.Wait()
	stop()
	o.Logf("chaos: load and faults over after %s; draining", time.Since(start).Round(time.Second))

	drainStart := time.Now()
	r.heal()
	r.drain()
	r.report.DrainTime = time.Since(drainStart)
	for _, role := range r.roles {
		role.Stop()
	}
	r.collectCounters()
	r.check()
	return r.report
}

// waitRoles waits up to 90 s for ready, and otherwise fails the run with
// the roles' last log lines (the log directory goes with the test: show
// why here).
func (r *run) waitRoles(what string, ready func() (bool, string)) {
	deadline := time.Now().Add(90 * time.Second)
	for {
		ok, why := ready()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			for _, role := range r.roles {
				r.t.Logf("%s's last log lines:\n%s", role.Name, tailFile(filepath.Join(r.logDir, role.Name+".log"), 12))
			}
			r.t.Fatalf("waited 90 s for %s: %s", what, why)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// load writes the shop's traffic at the rate, and plants bad input.
func (r *run) load(ctx context.Context) {
	d := &demo.Driver{Pool: r.db.Pool, Rate: r.o.Rate, Rand: rand.New(rand.NewPCG(r.o.Seed, 2)), Logger: quietLogger(),
		Mix: demo.Mix{Price: 30, Sale: 4, Stock: 25, Order: 15, Lifecycle: 10, Create: 6, Delete: 4, RenameBrand: 4, RenameCategory: 2}}
	var wg sync.WaitGroup
	var bulk, bulkEvents atomic.Int64
	wg.Add(3)
	go func() {
		defer wg.Done()
		_ = d.Run(ctx)
	}()
	go func() {
		defer wg.Done()
		// A transaction of over 1000 events now and then: relays
		// publish it in chunks.
		every := max(r.o.Duration/4, 10*time.Second)
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(every):
			}
			n, err := r.bulkReprice(ctx)
			if err != nil {
				if ctx.Err() == nil {
					r.o.Logf("chaos: bulk repricing: %v (Postgres may be restarting; tried again later)", err)
				}
				continue
			}
			bulk.Add(1)
			bulkEvents.Add(int64(n))
		}
	}()
	go func() {
		defer wg.Done()
		// Bad input and rolled-back orders, spread over the run.
		kinds := []func(context.Context) error{r.plantMalformedOrder, r.plantBadEventType, r.plantOversized,
			r.plantOrderWithMissingProduct, r.plantRejectedProduct, r.rolledBackOrder, r.plantBadHeaders}
		every := max(r.o.Duration/time.Duration(2*len(kinds)+1), time.Second)
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-time.After(every):
			}
			if err := kinds[i%len(kinds)](ctx); err != nil && ctx.Err() == nil {
				r.o.Logf("chaos: planting: %v (Postgres may be restarting; tried again later)", err)
			}
		}
	}()
	wg.Wait()
	r.report.Writes = d.Written()
	r.report.FailedWrites = d.Failed()
	r.report.Bulk, r.report.BulkEvents = bulk.Load(), bulkEvents.Load()
}

// readCache reads products through the cache, so fills race the
// invalidations.
func (r *run) readCache(ctx context.Context) {
	rdb := redis.NewClient(&redis.Options{Addr: r.rproxy.Addr})
	defer rdb.Close()
	cache := cacheinval.NewCache(rdb, r.db.Pool, 2*time.Second, 10*time.Second)
	var maxID atomic.Int64
	for ctx.Err() == nil {
		if maxID.Load() == 0 || r.readRand.intn(50) == 0 {
			var m int64
			_ = r.db.Pool.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM products`).Scan(&m)
			maxID.Store(m)
		}
		if m := maxID.Load(); m > 0 {
			_, _, _ = cache.Product(ctx, 1+int64(r.readRand.intn(int(m))))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// heal ends every fault: proxies restored, servers and roles running.
func (r *run) heal() {
	r.sproxy.Restore()
	r.rproxy.Restore()
	for _, p := range r.nproxy {
		p.Restore()
	}
	for _, s := range r.nats {
		if !s.Running() {
			if err := s.Restart(); err != nil {
				r.o.Logf("chaos: heal nats-server: %v", err)
			}
		}
	}
	for _, role := range r.roles {
		if !role.Alive() {
			if err := role.Start(); err != nil {
				r.o.Logf("chaos: heal %s: %v", role.Name, err)
			}
		}
	}
}

// walUnsent is how much wal relays have left: the rows committed before
// the slot still to be claimed, plus 1 while the slot is not confirmed past
// end (the WAL position when the load stopped, after every outbox insert).
func (r *run) walUnsent(ctx context.Context, end string) (int, error) {
	var n int
	err := r.db.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM outbox o, relay_capture c
        WHERE c.slot_name = $1 AND o.id <= c.backlog_through AND o.status IN ('pending', 'sending'))
     + (SELECT count(*) FROM relay_capture WHERE slot_name = $1 AND backlog_done_at IS NULL)
     + coalesce((SELECT (confirmed_flush_lsn < $2::pg_lsn)::int FROM pg_replication_slots WHERE slot_name = $1), 1)`,
		r.db.Name, end).Scan(&n)
	return n, err
}

// drain waits until the outbox is empty and every subscriber caught up.
// auditWait is how long the drain waits for the relays' auditor to look
// back after a store rollback (a sabotaged build has none: the checker
// then finds the events the stream lost).
const auditWait = time.Minute

// lookedBack says whether the relays' auditor has checked every landing
// since the last store rollback (true without one): it finished a
// lookback begun after the rollback, and its continuous audit has passed
// every landing recorded so far. A lookback reads the landings recorded
// when it began; a batch the stream acknowledged before the rollback but
// whose landing was recorded after (its relay waiting out a Postgres
// outage) is the continuous audit's. The events the stream lost are then
// published again, and the drain waits for the subscribers to take them.
func (r *run) lookedBack(ctx context.Context) bool {
	r.lostMu.Lock()
	since := r.rolledBack
	r.lostMu.Unlock()
	if since.IsZero() {
		return true
	}
	var looked, tailDone bool
	err := r.db.Pool.QueryRow(ctx, `SELECT
		EXISTS (SELECT FROM outbox_audits WHERE kind = 'lookback' AND started_at > $1 AND scope NOT LIKE '%did not finish%'),
		(SELECT tail_landing FROM outbox_audit_state) >= (SELECT coalesce(max(id), 0) FROM outbox_landings)`, since).Scan(&looked, &tailDone)
	return err == nil && looked && tailDone
}

func (r *run) drain() {
	drainStart := time.Now()
	deadline := drainStart.Add(4 * time.Minute)
	var state string
	var end string // wal capture: the WAL position after the last insert
	for r.wal() && end == "" && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := r.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
			time.Sleep(500 * time.Millisecond)
		}
		cancel()
	}
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var unsent int
		err := r.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')`).Scan(&unsent)
		if r.wal() && err == nil {
			// Rows the slot delivered stay pending: the relays are done
			// when the slot is past every insert.
			unsent, err = r.walUnsent(ctx, end)
		}
		idle := err == nil && unsent == 0
		state = fmt.Sprintf("unsent %d (%v)", unsent, err)
		if idle && !r.lookedBack(ctx) && time.Since(drainStart) < auditWait {
			idle, state = false, state+"; the auditor has not checked every landing since the stores' rollback"
		}
		if done, why := r.backfillsDone(ctx); !done {
			idle, state = false, state+"; "+why
		}
		for _, name := range r.subscriberNames() {
			c, err := r.js.Consumer(ctx, "EVENTS", name)
			if err != nil {
				idle, state = false, state+"; "+name+": "+err.Error()
				continue
			}
			info, err := c.Info(ctx)
			if err != nil || info.NumPending > 0 || info.NumAckPending > 0 {
				idle = false
				if info != nil {
					state += fmt.Sprintf("; %s pending %d ack pending %d", name, info.NumPending, info.NumAckPending)
				}
			}
		}
		cancel()
		if idle {
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
	r.report.violate("drain", "the pipeline did not drain within 4 minutes: "+state)
}

func (r *run) teardown() {
	for _, role := range r.roles {
		role.close()
	}
	for _, p := range slices.Concat(r.nproxy, []*faultproxy.Proxy{r.sproxy, r.rproxy}) {
		if p != nil {
			p.Close()
		}
	}
	if r.admin != nil {
		r.admin.Close()
	}
	if r.adminDL != nil && r.adminDL != r.admin {
		r.adminDL.Close()
	}
}

// pool is the chaos driver's Postgres.
func (r *run) pool() *pgxpool.Pool { return r.db.Pool }

func inTx(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, pool, fn)
}

// tailFile returns the last n lines of the file at path (or why not).
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
