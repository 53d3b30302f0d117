// Command relay is the relay benchmark (`go tool task bench:relay`). In one
// run, on the local services, it prints:
//
//	(a) fanout's relay draining 200k pending rows, rows/s
//	(b) the naive publisher (poll every 2 s, batch 50, one synchronous publish
//	    after another, then mark) for a fixed 20 s, rows/s
//	(c) raw JetStream async publish of 200k messages with msg ids, no Postgres
//	(m) the same of the relay's own messages (wire.Encode: the contract's
//	    headers), no Postgres: the ceiling a relay carrying them can reach
//	writer cost: price-update tx/s at 8 connections without and with the
//	    outbox insert and its wake-up (and with a NOTIFY in every transaction)
//	latency: commit → PubAck p50/p99 at a steady 1,000 writes/s
//	held horizon: the same rate while a transaction holds a snapshot for
//	    2 minutes: published/s, p99, claim time, outbox dead tuples (poll)
//	    and slot lag (wal) before, during and after, and over time
//	retention: removing one range of a million captured rows, row by row
//	    (and the vacuum after) against dropping the range: time and WAL
//	audit: the drains (poll and wal) with the auditor off, on, and on with
//	    no delay; the time of an audit of a million published rows
//	fsync: the drain and raw publishes against a server with the default
//	    sync_interval (2m) and one with sync_interval always
//	accounts (-only accounts): the drain and raw publishes as user relay
//	    through deploy/nats/nats-server.conf's service import, against the
//	    same inside the stream's account
//
// Each part uses a fresh database and a fresh stream; nothing is shared with
// the demo's data. Each figure is measured -runs times (default 3), each
// run after the database is settled (benchkit.Settle), and printed as the
// median and the range of the runs.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/events"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/gctune"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var (
	rows          = flag.Int("rows", 200_000, "rows for the drain and raw publish runs")
	naiveFor      = flag.Duration("naive", 10*time.Second, "how long the naive publisher runs")
	writerFor     = flag.Duration("writer", 10*time.Second, "how long each writer-cost run lasts")
	latencyFor    = flag.Duration("latency", 15*time.Second, "how long each latency run lasts")
	latencyRate   = flag.Int("rate", 1000, "writes/s of the latency and held-horizon runs")
	horizonFor    = flag.Duration("horizon", 2*time.Minute, "how long the held-horizon run holds its snapshot")
	captureOnly   = flag.String("capture", "", "run the held-horizon part in this capture mode only: poll or wal")
	horizonAtomic = flag.String("horizon-atomic", "", "the held-horizon part's relay.atomic (event, transaction; default: the relay's default)")
	batchSize     = flag.Int("batch", 0, "override relay.batch_size")
	maxInFlight   = flag.Int("inflight", 0, "override relay.max_in_flight")
	only          = flag.String("only", "", "run only these parts (a comma-separated list): a, w, b, c, m, writer, latency, horizon, audit, fsync, retention; only when asked: f (fast-ingest batches), accounts (the production NATS layout's cost), auditfull, bigtx")
	cpuProfile    = flag.String("cpuprofile", "", "write a CPU profile of this process")
	relayLog      = flag.String("relaylog", "", "log the relays at this level (debug, info, warn) to stderr")
	declared      = flag.Bool("declared", true, "the relays check each payload against the shop's declared event types, as `fanout relay` does (false: no check, as a relay embedded without Options.EventTypes)")
)

func main() {
	flag.Parse()
	ctx := context.Background()
	l, err := relayLogger(*relayLog)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	quiet = l
	// The relays here run in this process: give it the collector `fanout
	// relay` runs with.
	gctune.Apply()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		_ = pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	if err := run(ctx); err != nil {
		pprof.StopCPUProfile()
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	if err := benchkit.CheckRuns(); err != nil {
		return err
	}
	nc, err := nats.Connect(*benchkit.NATSURL, nats.ReconnectBufSize(-1))
	if err != nil {
		return fmt.Errorf("connect to nats (start the services: go tool task services): %w", err)
	}
	defer nc.Close()
	fmt.Printf("relay benchmark, %s, GOMAXPROCS=%d\n\n", time.Now().Format(time.RFC3339), runtime.GOMAXPROCS(0))
	if cpuClock, err = newCPUClock(ctx); err != nil {
		fmt.Printf("    (CPU per row not measured: %v)\n", err)
	}

	want := func(part string) bool { return *only == "" || slices.Contains(strings.Split(*only, ","), part) }
	if err := benchThroughput(ctx, nc, want); err != nil {
		return err
	}
	for _, p := range laterParts {
		if p.optIn && *only != p.name || !p.optIn && !want(p.name) {
			continue
		}
		if err := p.run(ctx, nc); err != nil {
			if p.label == "" {
				return err
			}
			return fmt.Errorf("%s: %w", p.label, err)
		}
	}
	return nil
}

// laterPart is one of the parts run after the throughput parts, in this
// order.
type laterPart struct {
	name  string // in -only
	label string // what its errors begin with ("": nothing)
	// optIn parts run only when -only is their name alone: accounts starts
	// a server of its own, auditfull is for profiling the audit, bigtx
	// takes minutes of 300,000-row transactions.
	optIn bool
	run   func(context.Context, *nats.Conn) error
}

var laterParts = []laterPart{
	{name: "writer", label: "writer cost", run: benchWriterCost},
	{name: "latency", label: "latency", run: benchLatency},
	{name: "horizon", label: "held horizon", run: benchHorizon},
	{name: "accounts", label: "accounts", optIn: true, run: benchAccounts},
	{name: "audit", label: "audit", run: benchAudit},
	{name: "auditfull", optIn: true, run: benchFullAudit},
	{name: "bigtx", label: "bigtx", optIn: true, run: benchBigTx},
	{name: "fsync", label: "fsync", run: benchFsync},
	{name: "retention", label: "retention", run: benchRetention},
}

// throughputPart is one of the parts measured once a run, side by side:
// a, w, b, c, m and f.
type throughputPart struct {
	name  string
	run   func(context.Context, *nats.Conn) (result, error)
	optIn bool // run only when -only names it
	rate  benchkit.Figure
	cpu   cpuFigure
}

// benchThroughput runs the throughput parts -only selects, and prints
// their figures and the ratios between them.
func benchThroughput(ctx context.Context, nc *nats.Conn, want func(string) bool) error {
	parts := []*throughputPart{{name: "a", run: benchDrain}, {name: "w", run: benchDrainWAL}, {name: "b", run: benchNaive},
		{name: "c", run: benchRaw}, {name: "m", run: benchRawRelayMessages}, {name: "f", run: benchFastIngest, optIn: true}}
	a, w, b, c, m, f := parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]
	ceilings := want("a") && want("w") && want("c") && want("m")
	var claimMs, wa, ab, ac, mc, am, wm, wc benchkit.Figure
	var aBound, wBound benchkit.Figure // servedFloor over c
	for run := range *benchkit.Runs {
		got := map[*throughputPart]result{}
		for _, p := range parts {
			if !want(p.name) || p.optIn && *only == "" {
				continue
			}
			res, err := p.run(ctx, nc)
			if err != nil {
				return fmt.Errorf("(%s): %w", p.name, err)
			}
			got[p] = res
			p.rate.Add(res.rate)
			p.cpu.add(res)
		}
		ra, rw, rb, rc, rm := got[a], got[w], got[b], got[c], got[m]
		if want("a") {
			claimMs.Add(ra.claimMs)
		}
		if ceilings {
			// The ceilings, within one run: the parts ran minutes apart at most.
			ac.Add(ra.rate / rc.rate)
			mc.Add(rm.rate / rc.rate)
			am.Add(ra.rate / rm.rate)
			wm.Add(rw.rate / rm.rate)
			wc.Add(rw.rate / rc.rate)
			if servedFloor(ra) > 0 && servedFloor(rw) > 0 {
				aBound.Add(servedFloor(ra) / rc.rate)
				wBound.Add(servedFloor(rw) / rc.rate)
			}
		}
		if *only == "" {
			wa.Add(rw.rate / ra.rate)
			ab.Add(ra.rate / rb.rate)
		}
		if want("a") || want("w") || want("b") || want("c") {
			fmt.Printf("    run %d of %d: a %.0f rows/s  w %.0f rows/s  b %.1f rows/s  c %.0f msgs/s  m %.0f msgs/s\n", run+1, *benchkit.Runs, ra.rate, rw.rate, rb.rate, rc.rate, rm.rate)
		}
	}
	if want("a") {
		fmt.Printf("(a) fanout relay (relay.capture poll) draining %d rows: %s; a claim took %s on average\n    %s\n", *rows, a.rate.Format("%.0f rows/s"), claimMs.Format("%.1fms"), a.cpu)
	}
	if want("w") {
		fmt.Printf("(w) fanout relay (relay.capture wal) draining %d rows from its slot (committed in transactions of 1000 while it was stopped): %s\n    %s\n", *rows, w.rate.Format("%.0f rows/s"), w.cpu)
	}
	if want("b") {
		fmt.Printf("(b) naive publisher (poll 2s, batch 50, sync publish, then mark) for %s: %s\n", *naiveFor, b.rate.Format("%.1f rows/s"))
	}
	if want("c") {
		fmt.Printf("(c) raw JetStream async publish, %d msgs with msg ids: %s\n    %s\n", *rows, c.rate.Format("%.0f msgs/s"), c.cpu)
	}
	if want("m") {
		fmt.Printf("(m) raw JetStream async publish of the relay's own messages (wire.Encode: its headers), %d msgs: %s\n    %s\n", *rows, m.rate.Format("%.0f msgs/s"), m.cpu)
	}
	if *only != "" && want("f") {
		fmt.Printf("(f) the same messages as m in one fast-ingest batch (allow_batched, an acknowledgement per 100): %s\n    %s\n", f.rate.Format("%.0f msgs/s"), f.cpu)
	}
	if ceilings {
		fmt.Printf("    ceilings: a/c = %s (target >= 0.5)   w/c = %s (target >= 0.7)   m/c = %s (what the messages' headers leave of c)   a/m = %s   w/m = %s\n\n",
			ac.Format("%.2f"), wc.Format("%.2f"), mc.Format("%.2f"), am.Format("%.2f"), wm.Format("%.2f"))
		if len(aBound.Values) > 0 {
			fmt.Printf("    what nats-server and Postgres use a row leaves, on %d cores, to a relay using no CPU itself: a/c <= %s, w/c <= %s\n\n",
				runtime.NumCPU(), aBound.Format("%.2f"), wBound.Format("%.2f"))
		}
	}
	if *only == "" {
		fmt.Printf("    a/c = %s (target >= 0.35)   a/b = %s (target >= 1000)   w/a = %s (target for wal: >= 1)\n\n", ac.Format("%.2f"), ab.Format("%.0f"), wa.Format("%.2f"))
	}
	return nil
}

type result struct {
	n       int
	rate    float64
	claimMs float64           // the drain's mean claim time
	cpu     benchkit.CPUTimes // used while timed; zero without a CPU clock
}

// cpuClock reads where a timed part's CPU went (nil where the servers'
// processes could not be found: the figures are then not printed).
var cpuClock *benchkit.CPUClock

// startCPU starts counting CPU time; the function it returns gives the
// time used since (zero without a clock, or if a read failed).
func startCPU() func() benchkit.CPUTimes {
	if cpuClock == nil {
		return func() benchkit.CPUTimes { return benchkit.CPUTimes{} }
	}
	start, err := cpuClock.Read()
	return func() benchkit.CPUTimes {
		end, err2 := cpuClock.Read()
		if err != nil || err2 != nil {
			return benchkit.CPUTimes{}
		}
		return end.Sub(start)
	}
}

// newCPUClock finds the services' processes (those of -nats and
// -postgres).
func newCPUClock(ctx context.Context) (*benchkit.CPUClock, error) {
	pool, err := pgxpool.New(ctx, *benchkit.AdminURL)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	return benchkit.NewCPUClock(ctx, pool, *benchkit.NATSURL)
}

// servedFloor is the most rows/s a relay using no CPU at all could reach
// with the CPU nats-server and Postgres used a row in r, on this
// machine's cores: the ceiling the machine sets (0 if not measured).
func servedFloor(r result) float64 {
	servers := (r.cpu.NATS + r.cpu.Postgres).Seconds() / float64(r.n)
	if servers <= 0 {
		return 0
	}
	return float64(runtime.NumCPU()) / servers
}

// cpuFigure is a part's CPU per row over the runs.
type cpuFigure struct{ self, nats, postgres benchkit.Figure }

func (f *cpuFigure) add(r result) {
	us := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(r.n) }
	if r.cpu != (benchkit.CPUTimes{}) {
		f.self.Add(us(r.cpu.Self))
		f.nats.Add(us(r.cpu.NATS))
		f.postgres.Add(us(r.cpu.Postgres))
	}
}

func (f cpuFigure) String() string {
	if len(f.self.Values) == 0 {
		return "CPU not measured"
	}
	return fmt.Sprintf("CPU a row: this process %s, nats-server %s, Postgres %s",
		f.self.Format("%.1fµs"), f.nats.Format("%.1fµs"), f.postgres.Format("%.1fµs"))
}

// quiet is the relays' logger: nothing, unless -relaylog names a level
// (their logs then go to stderr: a claim's time is logged at debug).
var quiet = benchkit.Quiet

func relayLogger(level string) (*slog.Logger, error) {
	if level == "" {
		return quiet, nil
	}
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("-relaylog: %w", err)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
}

// freshStream returns a stream config with a name and subject prefix of its
// own, and deletes the stream when done is called.
func freshStream(nc *nats.Conn) (stream.Config, func()) {
	s := stream.DefaultConfig()
	suffix := benchkit.Suffix()
	s.Name, s.SubjectPrefix = "BENCH_"+suffix, "bench"+suffix
	done := func() {
		js, err := jetstream.New(nc)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = js.DeleteStream(ctx, s.Name)
		}
	}
	return s, done
}

// eventTypes is what the relays check payloads against (-declared).
func eventTypes() *events.Catalog {
	if !*declared {
		return nil
	}
	return shop.EventTypes
}

func relayConfig() relay.Config {
	cfg := relay.DefaultConfig()
	if *batchSize > 0 {
		cfg.BatchSize = *batchSize
	}
	if *maxInFlight > 0 {
		cfg.MaxInFlight = *maxInFlight
	}
	return cfg
}

// fillOutbox inserts n pending product.updated rows with payloads like the
// demo's, over 1000 products, a statement (and a transaction) per 1000
// rows: one transaction numbering many events of one aggregate costs
// quadratically (docs/design.md, "Per-aggregate order"), and in one statement the
// 200,000 rows of a drain took 9 s to write instead of under 1 s.
func fillOutbox(ctx context.Context, pool *pgxpool.Pool, n int) error {
	const chunk = 1000
	for from := 1; from <= n; from += chunk {
		if _, err := pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'product', (g % 1000 + 1)::text, 'product.updated',
       jsonb_build_object('product_id', g % 1000 + 1, 'version', g, 'price_cents', 1000 + g % 90000)
FROM generate_series($1::bigint, $2::bigint) AS g`, from, min(from+chunk-1, n)); err != nil {
			return err
		}
	}
	return nil
}

// relayPool is the pool `fanout relay` opens with the default
// configuration: postgres.max_conns connections, synchronous_commit off
// (connect.AsyncCommit).
func relayPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	cfg := connect.DefaultPostgres()
	cfg.URL = url
	return connect.Postgres(ctx, cfg, "relay", connect.AsyncCommit(), connect.NoJIT())
}

func poolWithConns(ctx context.Context, url string, n int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pc.MaxConns, pc.MinConns = n, n
	return pgxpool.NewWithConfig(ctx, pc)
}
